"""Which servers `omni-pd bench serve` measures: stage configs with their overrides
(`PATH@key=value`), the --xpyd layouts and their colocated baselines with each thinker worker's
CPUs (xpyd_layouts.py), unique labels, and the environment the started servers get."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import NamedTuple

import yaml

from ..config.cpus import CpuSet, format_cpulist
from ..paths import STAGE_CONFIGS_DIR
from .xpyd_layouts import parse_layouts, runtime_cpus, share_cpus

REPO_ROOT = STAGE_CONFIGS_DIR.parent
# PATH@key=value keys set in every stage's kv_connector_extra_config (P/D configs only).
KV_OVERRIDES = ("transfer_mode", "kv_same_host", "kv_push_chunk_tokens")


def resolve_config(text: str, scratch: Path, ignore_eos: bool = False) -> tuple[str, Path]:
    """`PATH` or `PATH@key=value[@key=value...]` (top-level YAML keys set on a copy, e.g.
    `...pd.yaml@async_chunk=false`): the label and the file to serve. `ignore_eos`: a copy with
    ignore_eos in every stage's default sampling params."""
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
                args = stage.get("engine_args", {})
                role = (args.get("kv_transfer_config") or {}).get("kv_role")
                if args.get("engine") == "vllm" and role in ("kv_consumer", "kv_both"):
                    # Left alone: an omni thinker's vLLM decode stage refuses it (its KV is
                    # pulled), and a text model's keeps vLLM's default.
                    continue
                if args.get("model_stage") == "thinker":
                    args["enable_prefix_caching"] = bool(yaml.safe_load(value))
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


class XpydTarget(NamedTuple):
    label: str  # the layout: "1P1D", "colocated-2x"
    config: Path  # the stage YAML written for it
    baseline: str | None  # the colocated layout it is measured against (None: it is one)
    cpus: dict[str, list[str]]  # each thinker worker's cpulist by role, one per replica


def xpyd_targets(
    layouts: str, pd_config: str, colocated_config: str, scratch: Path, cpus: CpuSet | None
) -> list[XpydTarget]:
    """Each layout of `--xpyd` (xpyd_layouts.py) and each P/D layout's colocated baseline,
    baselines first, as a config with its thinker replicas pinned to their share of `cpus`
    (None: not pinned)."""
    files = {"pd": pd_config, "colocated": colocated_config}
    sources: dict[str, tuple[dict, Path]] = {}  # read when a layout first needs one
    out: list[XpydTarget] = []
    for layout in parse_layouts(layouts):
        for wanted in (layout.baseline, layout):
            if wanted is None or wanted.label in [t.label for t in out]:
                continue
            kind = "colocated" if wanted.colocated else "pd"
            if kind not in sources:
                sources[kind] = _xpyd_source(files[kind])
            data, source = copy.deepcopy(sources[kind])
            shares = share_cpus(cpus, wanted) if cpus is not None else {}
            for role, count in wanted.replicas().items():
                stage = _thinker_stage(data, role, source, pinned=cpus is not None)
                runtime = stage.setdefault("runtime", {})
                runtime["num_replicas"] = count
                if role in shares:
                    runtime["cpus"] = runtime_cpus(shares[role])
            config = scratch / f"{wanted.label}.yaml"
            config.write_text(yaml.safe_dump(data, sort_keys=False))
            baseline = wanted.baseline.label if wanted.baseline else None
            lists = {role: [format_cpulist(s) for s in sets] for role, sets in shares.items()}
            out.append(XpydTarget(wanted.label, config, baseline, lists))
    return out


def _xpyd_source(text: str) -> tuple[dict, Path]:
    path = Path(text).expanduser()
    found = next((c.resolve() for c in (path, REPO_ROOT / path) if c.is_file()), None)
    if found is None:
        raise SystemExit(f"error: stage config {text!r} not found (here or under {REPO_ROOT})")
    return yaml.safe_load(found.read_text()), found


_ROLES = {
    "prefill": lambda s: s.get("is_prefill_only"),
    "decode": lambda s: s.get("is_decode_only"),
    "thinker": lambda s: s.get("engine_args", {}).get("model_stage") == "thinker",
}


def _thinker_stage(data: dict, role: str, source: Path, pinned: bool) -> dict:
    """The one stage of `data` in `role`; when `pinned`, one whose threads or CPUs the file sets
    already is refused, since --xpyd-cpus sets them."""
    stages = [s for s in data.get("stage_args", []) if _ROLES[role](s)]
    if len(stages) != 1:
        raise SystemExit(f"error: --xpyd needs stage_args with exactly one {role} stage in {source}")
    set_here = sorted({"cpus", "num_threads"} & set(stages[0].get("runtime") or {}))
    if pinned and set_here:
        raise SystemExit(
            f"error: --xpyd pins the {role} stage (stage {stages[0].get('stage_id')}) of {source} "
            f"to its share of --xpyd-cpus, one thread per CPU: remove its runtime."
            f"{' and runtime.'.join(set_here)}"
        )
    return stages[0]


def unique_labels(labels: list[str]) -> list[str]:
    """A repeated label gets -2, -3, ..."""
    out: list[str] = []
    seen: dict[str, int] = {}
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
