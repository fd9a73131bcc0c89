"""vllm-omni 0.30's deploy schema (`--deploy-config`) -> omni-pd's `PipelineConfig`.

A deploy file carries deployment knobs keyed by `stage_id`; the model's pipeline (stage roles,
inputs, processors, outputs) is built in (`omni_pd.models.qwen3_omni.topology`), chosen by the
`pipeline:` key, else `qwen3_omni_moe`, or `qwen3_omni_moe_pd` when stages are marked
`is_prefill_only` / `is_decode_only`. After `base_config` inheritance (`deploy_yaml`) and the
`platforms:` section of the platform omni-pd runs on, the file becomes a legacy `stage_args`
document validated by `pipeline_config_from_dict`: every check a stage_args file gets (P/D pair
included) applies, its issues renamed to the deploy file and key.

Keys omni-pd cannot honour are refused by name, each with its reason (the tables below).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omni_pd.config.deploy_keys import DeployKeyMap
from omni_pd.config.deploy_yaml import (
    PLATFORMS,
    DeployDocument,
    merge_values,
    read_deploy_document,
)
from omni_pd.config.errors import ConfigError, ConfigIssue
from omni_pd.config.stage_args import pipeline_config_from_dict
from omni_pd.config.pydantic_issues import suggest
from omni_pd.config.schema import EngineArgsConfig, PipelineConfig, StageRuntime
from omni_pd.config.topology import Topology, TopologyStage
from omni_pd import registry

log = logging.getLogger(__name__)

# vllm-omni's pipeline-wide engine settings: given to every stage that does not set its own.
PIPELINE_WIDE_ENGINE_KEYS: tuple[str, ...] = (
    "trust_remote_code",
    "distributed_executor_backend",
    "dtype",
    "quantization",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "data_parallel_size",
    "pipeline_parallel_size",
)
# Top-level keys accepted only at their no-op value: (that value, why another one is refused).
NOOP_TOP_KEYS: dict[str, tuple[Any, str]] = {
    "session_mode": (
        "turn",
        "duplex sessions (concurrent input, interruptible turns) are "
        "vllm-omni's; omni-pd serves one turn per request",
    ),
    "model_runner": (
        "v1",
        "vLLM's model runner v2 is not used: omni-pd's hf engine is its own "
        "model runner and its vllm stages run v1",
    ),
    "active_stream_window": (
        0,
        "vllm-omni's active speech stream slots; omni-pd's engines batch every running request",
    ),
}
REFUSED_TOP_KEYS: dict[str, str] = {
    "duplex_session": "it configures duplex sessions, which omni-pd does not implement",
    "forced_aligner": "it appends vllm-omni's forced-aligner stage (TTS word timestamps); "
    "omni-pd's pipelines have no such stage",
    "custom_voice_dir": "vllm-omni's TTS custom voices; omni-pd speaks the checkpoint's voices",
}
_HANDLED_TOP_KEYS = ("stages", "platforms", "pipeline", "async_chunk", "connectors", "edges", "base_config")
TOP_KEYS: frozenset[str] = frozenset(
    (*_HANDLED_TOP_KEYS, *PIPELINE_WIDE_ENGINE_KEYS, *NOOP_TOP_KEYS, *REFUSED_TOP_KEYS)
)

# Per-stage keys with a meaning of their own; every other key is an engine argument.
STAGE_KEYS: frozenset[str] = frozenset(
    {
        "stage_id",
        "devices",
        "env",
        "num_replicas",
        "async_chunk",
        "input_connectors",
        "output_connectors",
        "default_sampling_params",
        "default_pooling_params",
        "runtime",
        "engine_args",
        "engine_extras",
        "is_prefill_only",
        "is_decode_only",
    }
)
# What the built-in pipeline decides; a deploy file picks another pipeline instead.
TOPOLOGY_KEYS: frozenset[str] = frozenset(
    {
        "model_stage",
        "model_arch",
        "hf_config_name",
        "engine_output_type",
        "engine_input_source",
        "input_sources",
        "custom_process_input_func",
        "custom_process_next_stage_input_func",
        "final_output",
        "final_output_type",
        "stage_type",
        "is_comprehension",
        "worker_type",
    }
)
REFUSED_STAGE_KEYS: dict[str, str] = {
    "default_pooling_params": "pooling outputs; omni-pd's Qwen3-Omni stages generate",
}
# omni-pd's runtime keys other than devices/env: they live under a stage's `runtime:`.
RUNTIME_KEYS: frozenset[str] = frozenset(StageRuntime.model_fields) - {"devices", "env"}
# code2wav's chunking, which vllm-omni reads from the `extra` of the connector feeding code2wav.
CODEC_CHUNK_KEYS: tuple[str, ...] = (
    "initial_codec_chunk_frames",
    "codec_chunk_frames",
    "codec_left_context_frames",
)
_ENGINE_KEYS: frozenset[str] = frozenset(EngineArgsConfig.model_fields)

_logged_connectors: set[str] = set()


@dataclass(frozen=True)
class DeployLoad:
    config: PipelineConfig
    pipeline: str  # the built-in topology used
    platform: str  # whose `platforms:` section applied
    files: tuple[str, ...]  # the deploy file, then its base_config chain
    notes: tuple[str, ...]  # what omni-pd made of the file, for validate-config


def detect_platform() -> str:
    """The `platforms:` section that applies here: cuda / rocm / xpu where torch sees such a
    device, else omni-pd's `cpu`. (npu and musa are chosen explicitly: `platform=`.)"""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return "cpu"


def load_deploy_config(
    path: str | Path, *, platform: str | None = None, check_imports: bool = True
) -> PipelineConfig:
    """Read a deploy file and return the pipeline it describes, or raise one ConfigError."""
    return load_deploy(path, platform=platform, check_imports=check_imports).config


def load_deploy(path: str | Path, *, platform: str | None = None, check_imports: bool = True) -> DeployLoad:
    """`load_deploy_config` plus what was chosen (pipeline, platform, base files) and why."""
    if platform is not None and platform not in PLATFORMS:
        raise ConfigError(
            [ConfigIssue(str(path), None, "<platform>", platform, ", ".join(PLATFORMS), "unknown platform")]
        )
    doc = read_deploy_document(path)
    conv = _Converter(doc, platform or detect_platform())
    stage_args = conv.convert()
    issues = list(conv.issues)
    config = None
    if stage_args is not None:
        try:
            config = pipeline_config_from_dict(stage_args, file=doc.file, check_imports=check_imports)
        except ConfigError as exc:
            issues.extend(conv.keys.translate(issue) for issue in exc.issues)
    if issues:
        # A pipeline-wide key's problem is reported by every stage: once is enough.
        raise ConfigError({str(issue): issue for issue in issues}.values())
    assert config is not None and conv.topology is not None
    return DeployLoad(config, conv.topology.name, conv.platform, doc.files, tuple(conv.notes))


def _pipelines() -> dict[str, Topology]:
    return registry.topologies()


class _Converter:
    """One deploy document -> a stage_args document, collecting issues; `keys` records where each
    value came from, to rename the stage_args loader's issues."""

    def __init__(self, doc: DeployDocument, platform: str) -> None:
        self.doc, self.data, self.platform = doc, doc.data, platform
        self.issues: list[ConfigIssue] = []
        self.notes: list[str] = []
        self.topology: Topology | None = None
        self.keys = DeployKeyMap(doc)  # where each converted value was written

    # --- issues ---------------------------------------------------------------------------
    def _top(self, key: str, got: Any, allowed: str | None, message: str) -> None:
        file = self.doc.origin((key.split(".")[0],)).file
        self.issues.append(ConfigIssue(file, None, key, got, allowed, message))

    def _stage(self, sid: int, key: str, got: Any, allowed: str | None, message: str) -> None:
        origin = self.keys.stage_origin(sid, key)
        self.issues.append(ConfigIssue(origin.file, sid, origin.stage_key(sid, key), got, allowed, message))

    # --- conversion -----------------------------------------------------------------------
    def convert(self) -> dict[str, Any] | None:
        self._check_top_level()
        stages = {s["stage_id"]: s for s in self.data.get("stages", [])}
        topo = self.topology = self._select_pipeline(stages)
        if topo is None:
            return None
        self.keys.stage_ids = topo.stage_ids
        self._check_platform_stage_ids(topo)
        self._apply_platform(stages, topo)
        for sid in stages:
            if topo.stage(sid) is None:
                self._stage(
                    sid,
                    "stage_id",
                    sid,
                    f"one of the stage ids of pipeline {topo.name} ({topo.describe()})",
                    f"pipeline {topo.name} has no stage {sid}; set `pipeline:` to the one you mean",
                )
        async_chunk = self.data.get("async_chunk", True)  # vllm-omni's deploy default
        if not isinstance(async_chunk, bool):
            self._top("async_chunk", async_chunk, "true or false", "async_chunk must be a boolean")
            async_chunk = True
        out = {
            ts.stage_id: self._convert_stage(ts, stages.get(ts.stage_id) or {}, async_chunk)
            for ts in topo.stages
        }
        if len(topo.stages) == 1 and async_chunk:
            async_chunk = False  # as vllm-omni: nothing to stream between
            self.notes.append("async_chunk: off (a one-stage pipeline has no stage to stream to)")
        connectors = self._connectors()
        self._codec_chunks(topo, stages, out, connectors)
        runtime: dict[str, Any] = {"enabled": True, "edges": self._edges(topo)}
        if connectors is not None:
            runtime["connectors"] = connectors
        return {"async_chunk": async_chunk, "stage_args": list(out.values()), "runtime": runtime}

    def _check_top_level(self) -> None:
        for key, value in self.data.items():
            if key in _HANDLED_TOP_KEYS or key in PIPELINE_WIDE_ENGINE_KEYS:
                continue
            if key in NOOP_TOP_KEYS:
                self._check_noop(key, value)
            elif key in REFUSED_TOP_KEYS:
                self._top(
                    key, value, "remove it", f"{key} is not supported by omni-pd: {REFUSED_TOP_KEYS[key]}"
                )
            else:
                hint = suggest(str(key), TOP_KEYS)
                self._top(
                    key,
                    value,
                    ", ".join(sorted(TOP_KEYS)),
                    f"unknown key '{key}'" + (f"; did you mean '{hint}'?" if hint else ""),
                )
        for name, section in (self.data.get("platforms") or {}).items():
            if "model_runner" in section:
                self._check_noop("model_runner", section["model_runner"], f"platforms.{name}.")

    def _check_noop(self, key: str, value: Any, prefix: str = "") -> None:
        noop, why = NOOP_TOP_KEYS[key]
        if value is None or (value == noop and type(value) is type(noop)):
            return
        file = self.doc.origin((key,)).file if not prefix else self.doc.file
        self.issues.append(
            ConfigIssue(
                file,
                None,
                prefix + key,
                value,
                f"{noop!r}, or remove it",
                f"{value!r} is not supported by omni-pd: {why}",
            )
        )

    def _select_pipeline(self, stages: dict[int, dict[str, Any]]) -> Topology | None:
        default_plain, default_pd = registry.default_topologies()
        pipelines = _pipelines()
        marked = [
            (sid, key)
            for sid, stage in stages.items()
            for key in ("is_prefill_only", "is_decode_only")
            if stage.get(key) is True
        ]
        name = self.data.get("pipeline")
        if name is None:
            name = default_pd if marked else default_plain
        elif not isinstance(name, str) or name not in pipelines:
            hint = suggest(str(name), pipelines)
            self._top(
                "pipeline",
                name,
                ", ".join(pipelines),
                "unknown pipeline" + (f"; did you mean '{hint}'?" if hint else ""),
            )
            return None
        topo = pipelines[name]
        if marked and not topo.has_pd:
            sid, key = marked[0]
            pd = pipelines[default_pd]
            self._stage(
                sid,
                key,
                True,
                f"pipeline: {pd.name} ({pd.describe()}), or remove {key}",
                f"pipeline {topo.name} has no prefill/decode stages",
            )
        why = (
            ""
            if "pipeline" in self.data
            else " (chosen by the stages' is_prefill_only / is_decode_only)"
            if marked
            else " (the default)"
        )
        self.notes.append(f"pipeline {topo.name}: {topo.describe()}{why}")
        return topo

    def _check_platform_stage_ids(self, topo: Topology) -> None:
        # vllm-omni ignores a platform entry for a stage it does not have; omni-pd refuses it so
        # that a typo is not lost (every section is checked, not only the one that applies).
        for name, section in (self.data.get("platforms") or {}).items():
            for stage in section["stages"]:
                sid = stage["stage_id"]
                if topo.stage(sid) is None:
                    origin = self.doc.origin(("platforms", name, sid, "stage_id"))
                    self.issues.append(
                        ConfigIssue(
                            origin.file,
                            sid,
                            origin.stage_key(sid, "stage_id"),
                            sid,
                            f"one of the stage ids of pipeline {topo.name} ({topo.describe()})",
                            f"platform {name} overrides stage {sid}, which pipeline {topo.name} does "
                            "not have",
                        )
                    )

    def _apply_platform(self, stages: dict[int, dict[str, Any]], topo: Topology) -> None:
        section = (self.data.get("platforms") or {}).get(self.platform)
        if section:
            for overlay in section["stages"]:
                sid = overlay["stage_id"]
                if topo.stage(sid) is None:
                    continue  # reported by _check_platform_stage_ids
                stages[sid] = merge_values(stages.get(sid, {"stage_id": sid}), overlay)
                for key in overlay:
                    self.keys.stage_origins[(sid, key)] = self.doc.origin(
                        ("platforms", self.platform, sid, key)
                    )
        applied = "applied" if section else "none in the file"
        self.notes.append(f"platform {self.platform}: its platforms section {applied}")

    def _convert_stage(self, ts: TopologyStage, ds: Mapping[str, Any], async_chunk: bool) -> dict[str, Any]:
        assert self.topology is not None
        sid = ts.stage_id
        engine: dict[str, Any] = {
            "model_stage": ts.model_stage,
            "model_arch": self.topology.model_arch,
            "engine_output_type": ts.engine_output_type,
        }
        if ts.hf_config_name:
            engine["hf_config_name"] = ts.hf_config_name
        for key in PIPELINE_WIDE_ENGINE_KEYS:
            if key in self.data:
                engine[key] = self.data[key]
                self.keys.engine_sources[(sid, key)] = ("top", key)
        runtime: dict[str, Any] = {"process": True}
        out: dict[str, Any] = {
            "stage_id": sid,
            "stage_type": "llm",
            "is_prefill_only": ts.role == "prefill",
            "is_decode_only": ts.role == "decode",
            "is_comprehension": ts.is_comprehension,
            "engine_input_source": list(ts.engine_input_source),
            "final_output": ts.final_output_type is not None,
            "final_output_type": ts.final_output_type,
            "default_sampling_params": dict(ts.default_sampling_params),
        }
        if ts.custom_process_input_func:
            out["custom_process_input_func"] = ts.custom_process_input_func
        for key, value in ds.items():
            if key != "stage_id":
                self._place_stage_key(ts, key, value, async_chunk, out, engine, runtime)
        out["engine_args"] = engine
        out["runtime"] = runtime
        return out

    def _place_stage_key(
        self,
        ts: TopologyStage,
        key: str,
        value: Any,
        async_chunk: bool,
        out: dict[str, Any],
        engine: dict[str, Any],
        runtime: dict[str, Any],
    ) -> None:
        """A deploy stage's key into the stage's own keys (`out`), its engine_args or its runtime;
        or reported, where omni-pd refuses it or does not know it."""
        assert self.topology is not None
        sid = ts.stage_id
        if key in ("devices", "env", "num_replicas"):
            runtime[key] = value
        elif key == "runtime":
            runtime.update(value)
        elif key == "async_chunk":
            if value is not None and value != async_chunk:
                self._stage(
                    sid,
                    key,
                    value,
                    f"{async_chunk} (the top-level async_chunk), or remove it",
                    "omni-pd streams between stages pipeline-wide only "
                    "(the top-level async_chunk); a stage cannot opt out",
                )
        elif key in ("input_connectors", "output_connectors"):
            out[key] = value
        elif key == "default_sampling_params":
            if value is not None:
                out[key] = value  # the file's defaults, as in vllm-omni (not merged)
        elif key in ("is_prefill_only", "is_decode_only"):
            self._check_role(ts, key, value)
        elif key in TOPOLOGY_KEYS:
            self._stage(
                sid,
                key,
                value,
                f"remove it, or choose another `pipeline:` ({', '.join(_pipelines())})",
                f"{key} is set by pipeline {self.topology.name} (stage {sid} is its {ts.label} stage)",
            )
        elif key in REFUSED_STAGE_KEYS:
            if value:
                self._stage(
                    sid,
                    key,
                    value,
                    "remove it",
                    f"{key} is not supported by omni-pd: {REFUSED_STAGE_KEYS[key]}",
                )
        elif key in RUNTIME_KEYS:
            self._stage(
                sid,
                key,
                value,
                f"runtime: {{{key}: ...}}",
                f"{key} is a runtime key of omni-pd's; write it under the stage's runtime:",
            )
        elif key in _ENGINE_KEYS:
            engine[key] = value
            self.keys.engine_sources.pop((sid, key), None)
        else:
            hint = suggest(str(key), STAGE_KEYS | _ENGINE_KEYS | RUNTIME_KEYS)
            self._stage(
                sid,
                key,
                value,
                "a deploy stage key (devices, env, "
                "default_sampling_params, input_connectors, ...) or one of "
                f"{len(_ENGINE_KEYS)} known engine keys (omni-pd, vllm-omni and vLLM "
                "EngineArgs names)",
                f"unknown key '{key}'" + (f"; did you mean '{hint}'?" if hint else ""),
            )

    def _check_role(self, ts: TopologyStage, key: str, value: Any) -> None:
        assert self.topology is not None
        want = ts.role == ("prefill" if key == "is_prefill_only" else "decode")
        if value is want or (value is None and not want):
            return
        if want:
            message = (
                f"stage {ts.stage_id} is the {ts.label} stage of pipeline "
                f"{self.topology.name}; {key} cannot be {value!r} there"
            )
        else:
            message = (
                f"stage {ts.stage_id} of pipeline {self.topology.name} is its {ts.label} "
                f"stage, not a {key.removeprefix('is_').removesuffix('_only')} stage "
                f"({self.topology.describe()})"
            )
        self._stage(ts.stage_id, key, value, f"{want}, or remove it", message)

    def _connectors(self) -> dict[str, Any] | None:
        connectors = self.data.get("connectors")
        if connectors is None:
            return None
        if not isinstance(connectors, Mapping):
            self._top(
                "connectors",
                connectors,
                "a mapping of names to {name: ConnectorClass, extra: {...}}",
                "connectors must be a mapping",
            )
            return None
        classes = sorted({str(c.get("name")) for c in connectors.values() if isinstance(c, Mapping)})
        if classes:
            self.notes.append(
                f"connectors {', '.join(connectors)} ({', '.join(classes)}): "
                "accepted as declarations; omni-pd moves stage outputs between its "
                "workers itself"
            )
            for name in classes:
                if name not in _logged_connectors:
                    _logged_connectors.add(name)
                    log.info(
                        "deploy connector %s is a declaration: omni-pd moves stage outputs "
                        "between its workers itself",
                        name,
                    )
        return dict(connectors)

    def _codec_chunks(
        self,
        topo: Topology,
        stages: dict[int, dict[str, Any]],
        out: dict[int, dict[str, Any]],
        connectors: Mapping[str, Any] | None,
    ) -> None:
        """vllm-omni sets a chunked decoder's chunking in the `extra` of the connector that feeds
        it: map those keys onto that stage's engine_args, which omni-pd's chunked engine reads."""
        kinds = registry.hf_stages()
        decoder = next((s for s in topo.stages if kinds.get(s.model_stage) == registry.CHUNKED), None)
        if decoder is None or not connectors:
            return
        sid, src = decoder.stage_id, decoder.engine_input_source[0]
        name_of = f"stage {sid} ({decoder.model_stage})"
        names = []
        for stage_id, field, slot in (
            (sid, "input_connectors", f"from_stage_{src}"),
            (src, "output_connectors", f"to_stage_{sid}"),
        ):
            wiring = (stages.get(stage_id) or {}).get(field)
            if isinstance(wiring, Mapping) and isinstance(wiring.get(slot), str):
                names.append(wiring[slot])
        found: dict[str, tuple[Any, str]] = {}
        for name in dict.fromkeys(names):
            spec = connectors.get(name)
            extra = spec.get("extra") if isinstance(spec, Mapping) else None
            if not isinstance(extra, Mapping):
                continue
            for key in CODEC_CHUNK_KEYS:
                if key not in extra:
                    continue
                if key in found and found[key][0] != extra[key]:
                    self._top(
                        f"connectors.{name}.extra.{key}",
                        extra[key],
                        f"{found[key][0]!r} (as connector {found[key][1]})",
                        f"two connectors feed {name_of} with different {key}",
                    )
                found.setdefault(key, (extra[key], name))
        engine = out[sid]["engine_args"]
        mapped = []
        for key, (value, name) in found.items():
            if key in engine:
                self.notes.append(
                    f"{name_of}: its own {key} ({engine[key]!r}) wins over connector {name}'s ({value!r})"
                )
                continue
            engine[key] = value
            self.keys.engine_sources[(sid, key)] = ("connector", name)
            mapped.append(f"{key}={value!r} (connector {name})")
        if mapped:
            self.notes.append(f"{name_of} chunking from its connector: {', '.join(mapped)}")

    def _edges(self, topo: Topology) -> list[dict[str, Any]]:
        """Runtime edges: the topology's, with window_size / max_inflight from the file's
        `edges`, each of which must be one of the topology's."""
        out: list[dict[str, Any]] = [{"from": a, "to": b} for a, b in topo.edges]
        index = {edge: i for i, edge in enumerate(topo.edges)}
        raw = self.data.get("edges")
        if raw is None:
            return out
        listed = ", ".join(f"{a} -> {b}" for a, b in topo.edges) or "none"
        if not isinstance(raw, list):
            self._top("edges", raw, "a list of {from, to, window_size, max_inflight}", "edges must be a list")
            return out
        for j, edge in enumerate(raw):
            if not isinstance(edge, Mapping):
                self._top(
                    f"edges[{j}]",
                    edge,
                    "a mapping {from, to, window_size, max_inflight}",
                    "edge entry is not a mapping",
                )
                continue
            pair = (edge.get("from"), edge.get("to"))
            if pair not in index:
                self._top(
                    f"edges[{j}]",
                    dict(edge),
                    f"an edge of pipeline {topo.name}: {listed}",
                    f"edge {pair[0]} -> {pair[1]} disagrees with pipeline {topo.name}, whose "
                    "stages are wired by the pipeline itself",
                )
            elif index[pair] in self.keys.edge_index:
                self._top(
                    f"edges[{j}]",
                    dict(edge),
                    "one entry per edge",
                    f"edge {pair[0]} -> {pair[1]} is listed twice "
                    f"(edges[{self.keys.edge_index[index[pair]]}])",
                )
            else:
                self.keys.edge_index[index[pair]] = j
                out[index[pair]].update({k: v for k, v in edge.items() if k not in ("from", "to")})
        return out
