"""Which servers `omni-pd bench serve` measures: stage configs with their overrides
(`PATH@key=value`), the --xpyd layouts and their colocated baselines, unique labels, and the
environment the started servers get."""

from __future__ import annotations

import re
from pathlib import Path

from ..paths import STAGE_CONFIGS_DIR

REPO_ROOT = STAGE_CONFIGS_DIR.parent
XPYD = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
# PATH@key=value keys set in every stage's kv_connector_extra_config (P/D configs only).
KV_OVERRIDES = ("transfer_mode", "kv_same_host", "kv_push_chunk_tokens")


def resolve_config(text: str, scratch: Path, ignore_eos: bool = False) -> tuple[str, Path]:
    """`PATH` or `PATH@key=value[@key=value...]` (top-level YAML keys set on a copy, e.g.
    `...pd.yaml@async_chunk=false`): the label and the file to serve. `ignore_eos`: a copy with
    ignore_eos in every stage's default sampling params."""
    import yaml

    name, *overrides = text.split("@")
    path = Path(name).expanduser()
    found = next((c.resolve() for c in (path, REPO_ROOT / path) if c.is_file()), None)
    if found is None:
        raise SystemExit(f"error: stage config {name!r} not found (here or under {REPO_ROOT})")
    if not overrides and not ignore_eos:
        return found.stem, found
    data = yaml.safe_load(found.read_text())
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: a config override is KEY=VALUE, got {override!r} in {text!r}")
        if key == "prefix_caching":  # every thinker stage's enable_prefix_caching
            for stage in data.get("stage_args", []):
                if stage.get("engine_args", {}).get("model_stage") == "thinker":
                    stage["engine_args"]["enable_prefix_caching"] = bool(yaml.safe_load(value))
            continue
        if key in KV_OVERRIDES:  # the P/D pair's KV handoff settings
            kv_stages = [
                s["engine_args"]["kv_transfer_config"]
                for s in data.get("stage_args", [])
                if s.get("engine_args", {}).get("kv_transfer_config")
            ]
            if not kv_stages:
                raise SystemExit(f"error: {text!r}: {key} needs a P/D config, {found} has no kv stages")
            for kv in kv_stages:
                # as written ("off" stays a string), but a chunk size is a number
                kv.setdefault("kv_connector_extra_config", {})[key] = (
                    int(value) if key == "kv_push_chunk_tokens" else value
                )
            continue
        if key == "load_format":  # every stage's: auto reads the served checkpoint's weights
            for stage in data.get("stage_args", []):
                stage.setdefault("engine_args", {})["load_format"] = value
            continue
        data[key] = yaml.safe_load(value)
    if ignore_eos:
        stages = data.get("stage_args") if isinstance(data, dict) else None
        if not isinstance(stages, list):
            raise SystemExit(
                f"error: --ignore-eos sets each stage's default_sampling_params, but "
                f"{found} has no stage_args list"
            )
        for stage in stages:
            stage.setdefault("default_sampling_params", {})["ignore_eos"] = True
    label = "@".join([found.stem, *overrides])
    copy = scratch / f"{label}.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return label, copy


def xpyd_targets(
    layouts: str, pd_config: str, colocated_config: str, scratch: Path
) -> list[tuple[str, Path, str | None]]:
    """(label, config, baseline label) for each layout and its colocated baseline, baselines
    first: colocated-Nx (the thinker with N = x + y replicas) then xPyD."""
    import yaml

    def load(text: str) -> tuple[dict, Path]:
        path = Path(text).expanduser()
        found = next((c.resolve() for c in (path, REPO_ROOT / path) if c.is_file()), None)
        if found is None:
            raise SystemExit(f"error: stage config {text!r} not found (here or under {REPO_ROOT})")
        return yaml.safe_load(found.read_text()), found

    def write(data: dict, label: str) -> Path:
        copy = scratch / f"{label}.yaml"
        copy.write_text(yaml.safe_dump(data, sort_keys=False))
        return copy

    def replicas(data: dict, which, count: int, source: Path) -> None:
        stages = [s for s in data.get("stage_args", []) if which(s)]
        if len(stages) != 1:
            raise SystemExit(f"error: --xpyd needs stage_args with exactly one such stage in {source}")
        stages[0].setdefault("runtime", {})["num_replicas"] = count

    out: list[tuple[str, Path, str | None]] = []
    for layout in (p.strip() for p in layouts.split(",") if p.strip()):
        match = XPYD.match(layout)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise SystemExit(f"error: --xpyd takes layouts such as 1P1D or 2P2D, got {layout!r}")
        x, y = int(match[1]), int(match[2])
        baseline = f"colocated-{x + y}x"
        if baseline not in [label for label, _, _ in out]:
            data, source = load(colocated_config)
            replicas(data, lambda s: s.get("engine_args", {}).get("model_stage") == "thinker", x + y, source)
            out.append((baseline, write(data, baseline), None))
        data, source = load(pd_config)
        replicas(data, lambda s: s.get("is_prefill_only"), x, source)
        replicas(data, lambda s: s.get("is_decode_only"), y, source)
        label = f"{x}P{y}D"
        out.append((label, write(data, label), baseline))
    return out


def unique_labels(labels: list[str]) -> list[str]:
    """A repeated label gets -2, -3, ..."""
    out, seen = [], {}
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}-{seen[label]}")
    return out


def parse_server_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --server-env takes KEY=VAL, got {pair!r}")
        env[key] = value
    return env
