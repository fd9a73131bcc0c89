"""Read a vllm-omni 0.30 deploy YAML: `base_config` inheritance and the merge rules.

Each file's stages are first put in one flat form (as vllm-omni's `_parse_stage_deploy` reads
them): keys nested under `engine_extras:` and `engine_args:` join the stage's flat keys
(`engine_extras` < flat < `engine_args`), and `runtime.devices` / `runtime.env` /
`runtime.num_replicas` become the flat `devices` / `env` / `num_replicas`. Then an overlay merges
onto its base (and a `platforms:` section onto the stages, see `omni_pd.config.deploy`) by one
rule: `stages` lists merge by `stage_id` (the base's order kept, new ids appended), mappings merge
key by key at every depth, and scalars and lists are replaced.

Every value keeps its origin (file, and `platforms.<name>.` when a platform section set it), so
a problem is reported against the file and key a user has to edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omni_pd.config.errors import ConfigError, ConfigIssue
from omni_pd.config.pydantic_issues import suggest
from omni_pd.config.yaml_io import read_yaml_mapping

# vllm-omni's platform names, plus omni-pd's `cpu` (a CPU-only machine).
PLATFORMS: tuple[str, ...] = ("cuda", "rocm", "npu", "xpu", "musa", "cpu")
PLATFORM_SECTION_KEYS: frozenset[str] = frozenset({"stages", "model_runner"})
_NESTED_ENGINE_KEYS = ("engine_extras", "engine_args")  # later wins
_RUNTIME_HOISTED = ("devices", "env", "num_replicas")


@dataclass(frozen=True)
class Origin:
    """Where a value was written: its file, and the key prefix of the section that holds it."""

    file: str
    prefix: str = ""  # "" or "platforms.<name>."

    def stage_key(self, stage_id: int, rest: str = "") -> str:
        key = f"{self.prefix}stages[stage_id={stage_id}]"
        return f"{key}.{rest}" if rest else key


# Origin keys: (top_key,), ("connectors", name), ("stages", stage_id, key),
# ("platforms", platform, stage_id, key).
OriginKey = tuple[Any, ...]


@dataclass
class DeployDocument:
    """A deploy file with its base_config chain merged in (stages in flat form)."""

    file: str  # the file the user named
    data: dict[str, Any]
    origins: dict[OriginKey, Origin] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # the file, then its base_config chain

    def origin(self, key: OriginKey) -> Origin:
        return self.origins.get(key, Origin(self.file))


def merge_values(base: Any, overlay: Any) -> Any:
    """Mappings merge key by key (recursively); anything else is replaced by the overlay."""
    if isinstance(base, Mapping) and isinstance(overlay, Mapping):
        out = dict(base)
        for key, value in overlay.items():
            out[key] = merge_values(base.get(key), value)
        return out
    return overlay


def merge_stage_lists(base: list[dict[str, Any]], overlay: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge two flat-form stage lists by stage_id (base order kept, new ids appended)."""
    by_id: dict[int, dict[str, Any]] = {s["stage_id"]: s for s in base}
    for stage in overlay:
        sid = stage["stage_id"]
        by_id[sid] = merge_values(by_id[sid], stage) if sid in by_id else stage
    return list(by_id.values())


def merge_documents(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if key == "stages":
            out[key] = merge_stage_lists(base.get("stages", []), value)
        elif key == "platforms":
            platforms = dict(base.get("platforms") or {})
            for name, section in value.items():
                old = platforms.get(name) or {}
                merged = merge_values(
                    {k: v for k, v in old.items() if k != "stages"},
                    {k: v for k, v in section.items() if k != "stages"},
                )
                merged["stages"] = merge_stage_lists(old.get("stages", []), section.get("stages", []))
                platforms[name] = merged
            out[key] = platforms
        else:
            out[key] = merge_values(base.get(key), value)
    return out


def flat_stage(raw: Mapping[str, Any], where: str, file: str, issues: list[ConfigIssue]) -> dict[str, Any]:
    """A stage entry in flat form (see the module docstring)."""
    nested = {}
    for name in (*_NESTED_ENGINE_KEYS, "runtime"):
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, Mapping):
            nested[name] = value
        else:
            issues.append(
                ConfigIssue(
                    file,
                    raw.get("stage_id"),
                    f"{where}.{name}",
                    value,
                    "a mapping of keys to values",
                    f"{name} must be a mapping",
                )
            )
    out: dict[str, Any] = dict(nested.get("engine_extras", {}))
    flat = {k: v for k, v in raw.items() if k not in (*_NESTED_ENGINE_KEYS, "runtime")}
    out = merge_values(out, flat)
    out = merge_values(out, dict(nested.get("engine_args", {})))
    runtime = dict(nested.get("runtime", {}))
    for key in _RUNTIME_HOISTED:
        if key in runtime:
            out[key] = runtime.pop(key)
    if runtime:
        out["runtime"] = runtime
    return out


def _stage_list(value: Any, where: str, file: str, issues: list[ConfigIssue]) -> list[dict[str, Any]]:
    """Flat-form stages of a `stages:` list; malformed entries are reported and left out."""
    if not isinstance(value, list):
        issues.append(
            ConfigIssue(
                file,
                None,
                where,
                value,
                "a list of stage mappings with a stage_id",
                f"{where} must be a list",
            )
        )
        return []
    out: list[dict[str, Any]] = []
    seen: dict[int, int] = {}  # stage_id -> index of the entry that declared it
    for index, raw in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(raw, Mapping):
            issues.append(
                ConfigIssue(file, None, at, raw, "a mapping with a stage_id", "stage entry is not a mapping")
            )
            continue
        sid = raw.get("stage_id")
        if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
            issues.append(
                ConfigIssue(
                    file,
                    None,
                    f"{at}.stage_id",
                    sid,
                    "an integer >= 0",
                    "every stage entry needs its stage_id",
                )
            )
            continue
        if sid in seen:
            issues.append(
                ConfigIssue(
                    file,
                    sid,
                    f"{at}.stage_id",
                    sid,
                    "one entry per stage_id (merge the two entries)",
                    f"duplicate stage_id; {where}[{seen[sid]}] already uses {sid}",
                )
            )
            continue
        seen[sid] = index
        out.append(flat_stage(raw, at, file, issues))
    return out


def _platforms(value: Any, file: str, issues: list[ConfigIssue]) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping):
        issues.append(
            ConfigIssue(
                file,
                None,
                "platforms",
                value,
                f"a mapping of platform names ({', '.join(PLATFORMS)}) to sections",
                "platforms must be a mapping",
            )
        )
        return {}
    out = {}
    for name, section in value.items():
        where = f"platforms.{name}"
        if name not in PLATFORMS:
            hint = suggest(str(name), PLATFORMS)
            issues.append(
                ConfigIssue(
                    file,
                    None,
                    where,
                    name,
                    ", ".join(PLATFORMS),
                    f"unknown platform '{name}'" + (f"; did you mean '{hint}'?" if hint else ""),
                )
            )
            continue
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            issues.append(
                ConfigIssue(
                    file,
                    None,
                    where,
                    section,
                    "a mapping with a stages list",
                    "a platform section must be a mapping",
                )
            )
            continue
        for key in section:
            if key not in PLATFORM_SECTION_KEYS:
                hint = suggest(str(key), PLATFORM_SECTION_KEYS)
                issues.append(
                    ConfigIssue(
                        file,
                        None,
                        f"{where}.{key}",
                        section[key],
                        ", ".join(sorted(PLATFORM_SECTION_KEYS)),
                        f"unknown key '{key}' in a platform section"
                        + (f"; did you mean '{hint}'?" if hint else ""),
                    )
                )
        out[name] = {k: v for k, v in section.items() if k in PLATFORM_SECTION_KEYS}
        out[name]["stages"] = _stage_list(section.get("stages", []), f"{where}.stages", file, issues)
    return out


def _own_document(
    raw: Mapping[str, Any], file: str, issues: list[ConfigIssue]
) -> tuple[dict[str, Any], dict[OriginKey, Origin]]:
    """One file's document in flat form, with the origin of each of its values."""
    data = dict(raw)
    origins: dict[OriginKey, Origin] = {}
    here = Origin(file)
    if "stages" in data:
        data["stages"] = _stage_list(data["stages"], "stages", file, issues)
        for stage in data["stages"]:
            origins.update({("stages", stage["stage_id"], k): here for k in stage})
    if "platforms" in data:
        data["platforms"] = _platforms(data["platforms"], file, issues)
        for name, section in data["platforms"].items():
            there = Origin(file, f"platforms.{name}.")
            for stage in section["stages"]:
                origins.update({("platforms", name, stage["stage_id"], k): there for k in stage})
    if isinstance(data.get("connectors"), Mapping):
        origins.update({("connectors", name): here for name in data["connectors"]})
    origins.update({(k,): here for k in data if k not in ("stages", "platforms")})
    return data, origins


def read_deploy_document(path: str | Path) -> DeployDocument:
    """The deploy file at `path` with its base_config chain merged in; raises one ConfigError
    listing every structural problem (malformed stage lists, a missing or cyclic base file)."""
    issues: list[ConfigIssue] = []
    doc = _resolve(Path(path), str(path), (), issues)
    if issues:
        raise ConfigError(issues)
    return doc


def _resolve(path: Path, file: str, seen: tuple[Path, ...], issues: list[ConfigIssue]) -> DeployDocument:
    raw = read_yaml_mapping(path, file)
    if "stage_args" in raw:
        issues.append(
            ConfigIssue(
                file,
                None,
                "stage_args",
                "a top-level stage_args list",
                "a deploy file's `stages` list, or pass this file with --stage-configs-path (omni-pd "
                "loads both schemas)",
                "this is vllm-omni's legacy stage_args schema, not a deploy file",
            )
        )
        return DeployDocument(file, {})
    data, origins = _own_document(raw, file, issues)
    base_ref = data.pop("base_config", None)
    origins.pop(("base_config",), None)
    doc = DeployDocument(file, data, origins, (file,))
    if base_ref is None:
        return doc
    if not isinstance(base_ref, str) or not base_ref:
        issues.append(
            ConfigIssue(
                file,
                None,
                "base_config",
                base_ref,
                "a path to another deploy YAML, relative to this file's directory",
                "base_config must be a file path",
            )
        )
        return doc
    base_path = path.parent / base_ref
    if base_path.resolve() in (*seen, path.resolve()):
        issues.append(
            ConfigIssue(
                file,
                None,
                "base_config",
                base_ref,
                "a base file that does not inherit from this one",
                f"base_config cycle: {base_path} is already in the chain",
            )
        )
        return doc
    if not base_path.is_file():
        issues.append(
            ConfigIssue(
                file,
                None,
                "base_config",
                base_ref,
                f"a path relative to {path.parent}",
                f"base file {base_path} not found",
            )
        )
        return doc
    try:
        base = _resolve(base_path, str(base_path), (*seen, path.resolve()), issues)
    except ConfigError as exc:  # the base file is unreadable or not YAML
        issues.extend(exc.issues)
        return doc
    return DeployDocument(
        file, merge_documents(base.data, data), {**base.origins, **origins}, (file, *base.files)
    )
