"""The short README and the documentation site (issue 41): the README stays short and keeps the two
set-up commands; every measured table that the long README held lives on a docs page beside the
command that made it; every page is in mkdocs.yml's nav and every nav entry is a page; the
README's links reach files and headings that exist. `mkdocs build --strict` (scripts/test.sh)
checks the links between the pages themselves."""

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"


def _norm(text: str) -> str:
    """Whitespace folded, shell line continuations too, so a wrapped command still matches."""
    return re.sub(r"\s+", " ", re.sub(r"\\\n", " ", text)).strip()


def _pages() -> dict[str, str]:
    return {p.name: _norm(p.read_text(encoding="utf-8")) for p in sorted(DOCS.glob("*.md"))}


# (the command, a row of the figures it measured) for every measured table of the README as it
# was before the docs site (commit 9c09901); a figure must stay on the same page as its command.
MEASURED = [
    (
        "`bash scripts/demo.sh` (tiny model, P/D across 4 worker processes",
        "| one request | TTFT ≈21-32 ms, end-to-end ≈140-280 ms |",
    ),
    (
        "vLLM stages (`omni-pd generate --json`, tiny-qwen3-text, 928-token prompt",
        "| `qwen3_text_pd_vllm.yaml` (prefill + decode engines) | 98 ms | 182 ms | 928 of 928 |",
    ),
    (
        ".venv/bin/omni-pd bench handoff --repeats 5 --json handoff.json",
        "| Qwen3-Omni-30B thinker (48 x 4 x 128, bf16) | 4096 | shm | 384.00 | 0 | 28.37 | 193.51 "
        "| 12.77 | 0.65 | 40.51 | 50.47 | 0.26 | 1.78 |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --configs stage_configs/ci/qwen3_omni_tiny.yaml,"
        "stage_configs/ci/qwen3_omni_tiny_pd.yaml,stage_configs/ci/qwen3_omni_tiny_pd.yaml"
        "@async_chunk=false --json docs/bench_serve.json --plot docs/bench_serve.png",
        "| qwen3_omni_tiny | 16 | 64 | 47.94 | 1151 | 37 ms | 94 ms | 114 ms | 330 ms | 352 ms "
        "| 7.04x | 2.25x |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --concurrency 1,8,16 --configs "
        "stage_configs/ci/qwen3_omni_tiny.yaml,stage_configs/ci/qwen3_omni_tiny_pd.yaml,"
        "stage_configs/ci/qwen3_omni_tiny_vllm.yaml,stage_configs/ci/qwen3_omni_tiny_vllm_pd.yaml "
        "--json docs/bench_serve_vllm.json --plot docs/bench_serve_vllm.png",
        "| vLLM thinker, P/D | 16 | 30.42 | 0.62x | 112 ms | 157 ms | 499 ms |",
    ),
    (
        ".venv/bin/omni-pd bench serve --realtime --ignore-eos --json docs/bench_realtime.json",
        "| P/D | 16 | 109.9 | 103.5 | 0.94x |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --multi-turn 4 --json docs/bench_multi_turn.json",
        "| P/D | 4 | 1,696 of ~1,751 | 22.1 | 96.1 | 0.23x | 49.2 | 119.6 |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --multi-turn 4 --audio-turns 2 --json "
        "docs/bench_multi_turn_audio.json",
        "| P/D | 4 | 1,792 | 34.2 | 106.6 | 0.32x | 65.4 | 138.0 |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --xpyd 1P1D,1P2D,2P2D --concurrency 1,4,16 "
        "--request-rate 50%,90% --slo-ttft-ms 200 --slo-ttfa-ms 400 --json docs/bench_xpyd.json "
        "--plot docs/bench_xpyd.png",
        "| 2P2D | 2 + 2 | 35.00 | 1.04x | 165 / 203 ms | 31.5/s | 59 / 771 ms | 109 / 207 ms "
        "| 19.24/s | 1.02x |",
    ),
    (
        ".venv/bin/omni-pd bench serve --ignore-eos --configs stage_configs/ci/qwen3_omni_tiny.yaml "
        "--concurrency 16 --request-rate 100%,200%,400% --open-loop-requests 256 --slo-ttft-ms 200 "
        "--slo-ttfa-ms 400 --serve-arg=--max-queued-requests=Q "
        "--json docs/bench_overload_queueQ.json",
        "| 100000 | 4x (158.9/s) | 0 | 1481 / 3405 ms | 1467 / 3402 ms | 2.59 / 3.97 s | 7.7/s |",
    ),
    (
        "Measured with `pytest e2e/test_faults.py -s`",
        "| soak: 1000 requests at concurrency 8, 25% aborted at random, prefill SIGKILLed halfway "
        "| 761 answered, 239 aborted, 0 failed;",
    ),
    (
        "$ omni-pd bench load /tmp/wt31_med2 --json load.json --plot load.png",
        "thinker 771.3 6/7 815.0 1.06 1066.7 0.50 1.49 18.50 0.08",
    ),
    (
        "--timeline docs/timeline_pd.png",
        "the first of four audio chunks leaves at 37 ms of 134 ms",
    ),
    (
        ".venv/bin/vllm bench serve --backend openai-chat --base-url http://127.0.0.1:8000",
        "it read a median of 11.3 ms, against 3.1 ms when a role-only chunk went ahead",
    ),
    (
        "(`tests/inproc_vllm_omni_thinker.py`, `e2e/test_vllm_omni.py`)",
        "| accept-layer rows | within 2.2e-8 (bound 1e-5);",
    ),
]


@pytest.mark.parametrize(("command", "row"), MEASURED, ids=[c[:48] for c, _ in MEASURED])
def test_measured_figure_keeps_its_command(command: str, row: str) -> None:
    pages = _pages()
    with_command = [name for name, text in pages.items() if _norm(command) in text]
    assert with_command, f"no docs page holds the command {command!r}"
    with_row = [name for name, text in pages.items() if _norm(row) in text]
    assert with_row, f"no docs page holds the figures {row!r}"
    assert set(with_command) & set(with_row), (
        f"the figures are on {with_row}, their command on {with_command}: keep them together"
    )


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move detail into docs/"
    block = re.search(r"## Two commands \(fresh machine\)\n+```bash\n(.*?)```", text, re.S)
    assert block, "README.md lost its 'Two commands (fresh machine)' block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def _nav_files(nav: list) -> list[str]:
    out: list[str] = []
    for entry in nav:
        value = entry if isinstance(entry, str) else next(iter(entry.values()))
        out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    pages = {p.name for p in DOCS.glob("*.md")}
    assert set(nav) == pages, (
        f"missing from the nav: {sorted(pages - set(nav))}; not a page: {sorted(set(nav) - pages)}"
    )
    # Strict builds fail on these only when mkdocs.yml makes them warnings.
    validation = config["validation"]
    for key in ("omitted_files", "not_found", "anchors", "unrecognized_links"):
        assert validation[key] == "warn", key


def _slug(heading: str) -> str:
    """Python-Markdown's toc slugify, as MkDocs uses it (markup stripped first)."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+?)\s*$", text)}


def test_readme_links_reach_files_and_headings() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        target, _, anchor = link.partition("#")
        path = (REPO / target) if target else README
        assert path.is_file(), f"README.md links to {link}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"README.md links to {link}: no such heading"


def test_slug_matches_mkdocs() -> None:
    # The anchors the README relies on, spelled as MkDocs spells them (checked on a built site).
    assert _slug("The voice demo page (`/demo/`)") == "the-voice-demo-page-demo"
    assert _slug("Overload: admission keeps admitted requests' latency") == (
        "overload-admission-keeps-admitted-requests-latency"
    )
    assert _slug("KV handoff: `omni-pd bench handoff`") == "kv-handoff-omni-pd-bench-handoff"
