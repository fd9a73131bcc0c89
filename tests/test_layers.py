"""The layers of docs/architecture.md, checked on the source: which package may import which,
that the layers that know no model hold no model code, and that no modules import each other in
a circle. Imports inside functions count: a lazy import is still an arrow."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "omni_pd"

# Layer of each top-level part of omni_pd, lowest first. A module may import its own layer and
# the layers below it, never one above. docs/architecture.md draws the same table.
LAYERS: dict[str, int] = {
    "registry": 0,
    "sampling": 0,
    "audio_io": 0,
    "paths": 0,
    "hops": 0,  # per-request hop stamps every process records (one clock per host)
    "faults": 0,  # the test-only fault hook registry production code consults
    "config": 1,
    "kv": 1,
    "planning": 2,
    "engines": 3,
    "models": 4,
    "orchestrator": 5,
    "entrypoints": 6,
    "bench": 6,
    "plan": 6,  # omni-pd plan: a tool beside bench (it reads bench's records and its roofline)
    "__init__": 6,  # omni_pd itself: the public names (Omni, SamplingParams), a facade on top
}
# The layers that know no model (issue 25): no model package imported, no model's name in code.
MODEL_FREE = ("engines", "kv", "orchestrator")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every omni_pd module `path` imports, at top level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("omni_pd"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("omni_pd"):
                continue
            for alias in node.names:  # `from omni_pd.x import y`: y is a module, or a name in x
                submodule = f"{module}.{alias.name}"
                found.add(submodule if _is_module(submodule) else module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _graph()}
    assert parts <= set(LAYERS), f"give {sorted(parts - set(LAYERS))} a layer in LAYERS"


def test_no_import_runs_back_up():
    upward = sorted(
        f"{a} -> {b}" for a, deps in _graph().items() for b in deps if LAYERS[_part(b)] > LAYERS[_part(a)]
    )
    assert upward == []


def test_no_import_circles():
    graph = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert circles == []


@pytest.mark.parametrize("layer", MODEL_FREE)
def test_model_free_layers_name_no_model(layer):
    for path in (ROOT / layer).rglob("*"):
        if path.suffix not in (".py", ".c"):
            continue
        text = path.read_text()
        assert not re.search("qwen", text, re.IGNORECASE), f"{path} names a model"
        if path.suffix == ".py":
            assert not {m for m in _imports(path) if m.startswith("omni_pd.models")}, path


def test_negative_control_the_checks_see_an_arrow_back_up_and_a_circle(tmp_path, monkeypatch):
    """The graph reader finds a lazy import running up and a two-module circle when they exist."""
    fake = tmp_path / "omni_pd"
    for module, text in {
        "__init__.py": "",
        "engines/__init__.py": "",
        "engines/a.py": "def f():\n    from ..models.m import x\n",
        "models/__init__.py": "",
        "models/m.py": "from omni_pd.models import n\nx = 1\n",
        "models/n.py": "from . import m\n",
    }.items():
        (fake / module).parent.mkdir(parents=True, exist_ok=True)
        (fake / module).write_text(module and text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    graph = _graph()
    assert "omni_pd.models.m" in graph["omni_pd.engines.a"]
    with pytest.raises(AssertionError):
        test_no_import_runs_back_up()
    with pytest.raises(AssertionError):
        test_no_import_circles()
    with pytest.raises(AssertionError):
        test_model_free_layers_name_no_model("engines")


# The generic layers name no stage of a model either (issue 37): which stages a model has, and
# what each is, comes from its ModelSpec. Comments and docstrings may use the names as examples.
STAGE_FREE = ("engines", "kv", "orchestrator", "config")
STAGE_NAMES = ("thinker", "talker", "code2wav")


def _code_without_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every token of `path` but comments and docstrings."""
    import io
    import tokenize

    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                docstrings.add((body[0].lineno, body[0].col_offset))
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type != tokenize.COMMENT and (tok.start[0], tok.start[1]) not in docstrings
    ]


def _stage_names_in(root: Path, layer: str) -> list[str]:
    found = []
    for path in sorted((root / layer).rglob("*.py")):
        for line, text in _code_without_comments(path):
            hits = [name for name in STAGE_NAMES if name in text.lower()]
            if hits:
                found.append(f"{path.relative_to(root)}:{line}: {text[:60]!r} names {hits}")
    return found


@pytest.mark.parametrize("layer", STAGE_FREE)
def test_generic_layers_name_no_model_stage(layer):
    assert _stage_names_in(ROOT, layer) == []


def test_negative_control_a_stage_name_in_code_is_seen_in_a_comment_is_not(tmp_path):
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "a.py").write_text(
        '"""The talker, in a docstring."""\n# the thinker, in a comment\n'
        'def f():\n    """code2wav in a docstring"""\n    return 1\n'
    )
    assert _stage_names_in(tmp_path, "engines") == []
    (tmp_path / "engines" / "b.py").write_text('NAME = "thinker.requests"\nclass HfTalkerEngine:\n    pass\n')
    found = _stage_names_in(tmp_path, "engines")
    assert len(found) == 2 and "thinker" in found[0] and "talker" in found[1]


# Issue 46: the engine core owns its caches and its attention. It imports nothing of the hf
# kernels (they reach it as a ComputeBackend a runner brings), and no model indexes a block
# table, a slot or the paged cache: a model's layers call the step's attention with q, k, v.
CORE, HF = "omni_pd.engines.core", "omni_pd.engines.hf"


def _core_imports_of_hf(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == CORE or module.startswith(CORE + ".")
        for target in targets
        if target == HF or target.startswith(HF + ".")
    )


def test_the_engine_core_imports_nothing_of_the_hf_engines():
    assert _core_imports_of_hf(_graph()) == []


def test_negative_control_a_core_import_of_hf_is_seen():
    graph = {f"{CORE}.ar_engine": {f"{HF}.batch_invariant", f"{CORE}.scheduler"}, f"{HF}.compute": {CORE}}
    assert _core_imports_of_hf(graph) == [f"{CORE}.ar_engine imports {HF}.batch_invariant"]


# What only the engine may touch: the paged cache and its kernels' entry points, and a request's
# block table and slots (attributes read off anything but `self`: a model's own `self.blocks`,
# e.g. a vocoder's conv blocks, is its own business).
KV_INTERNALS = frozenset({"PagedKVCache", "paged_cache", "DecodeRows", "paged_geometry", "decode_attention"})
KV_ATTRIBUTES = frozenset({"blocks", "block_table", "slot_mapping", "write_token", "layer_kv", "cached_len"})


def _kv_indexing_in(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {alias.name.rpartition(".")[2] for alias in node.names}
                names |= set((getattr(node, "module", None) or "").split("."))
                found += [f"{where}: imports {n}" for n in sorted(names & KV_INTERNALS)]
            elif isinstance(node, ast.Name) and node.id in KV_INTERNALS:
                found.append(f"{where}: uses {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in KV_ATTRIBUTES:
                if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(f"{where}: reads .{node.attr}")
    return found


def test_no_model_sees_a_kv_block():
    assert _kv_indexing_in(ROOT / "models") == []


def test_negative_control_block_indexing_in_a_model_is_seen(tmp_path):
    (tmp_path / "fine.py").write_text(
        "class Vocoder:\n    def __init__(self):\n        self.blocks = []\n\n"
        "def forward(attention, q, k, v):\n    return attention(0, q, k, v, 1.0)\n"
    )
    assert _kv_indexing_in(tmp_path) == []
    (tmp_path / "bad.py").write_text(
        "from omni_pd.engines.core.paged_cache import PagedKVCache\n\n"
        "def decode(requests, cache):\n"
        "    for r in requests:\n        cache.write_token(0, r.blocks, r.position, None, None)\n"
    )
    found = _kv_indexing_in(tmp_path)
    assert any("imports PagedKVCache" in f for f in found)
    assert any(".write_token" in f for f in found) and any(".blocks" in f for f in found)
