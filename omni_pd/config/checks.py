"""Rules that span keys or stages: ids, the stage graph, the P/D pair, imports, connectors.

Each check takes the stages that passed schema validation (with their index in `stage_args`)
and returns issues; none raises, so the loader can report everything at once. When some stages
failed schema validation (`complete=False`), checks that would need them are skipped rather than
reporting misleading follow-on errors.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from omni_pd import registry
from omni_pd.config.errors import ConfigIssue
from omni_pd.config.pydantic_issues import suggest
from omni_pd.config.schema import KVConnectorExtraConfig, KVTransferConfig, PipelineRuntime, StageConfig

# omni-pd's engine_args keys that only its hf engines read: on a vLLM stage they would do nothing
# (and those each registered model declares, with its reason).
_CHUNKED = "a chunked decoder stage runs on engine: hf"
HF_ONLY_KEYS: dict[str, str] = {
    "kv_block_size": "set vLLM's block_size instead",
    "kv_pool_blocks": "vLLM sizes its KV cache itself (VLLM_CPU_KVCACHE_SPACE on CPU, "
    "gpu_memory_utilization on GPUs)",
    "attention_kernels": "vLLM picks its own attention backend",
    "initial_codec_chunk_frames": _CHUNKED,
    "codec_chunk_frames": _CHUNKED,
    "codec_left_context_frames": _CHUNKED,
    **{name: arg.why_hf_only for name, arg in registry.model_engine_args().items()},
}
PREFILL_ROLES: frozenset[str] = frozenset({"kv_producer", "kv_both"})
DECODE_ROLES: frozenset[str] = frozenset({"kv_consumer", "kv_both"})
_CONNECTOR_KEY = {
    "input_connectors": re.compile(r"^from_stage_(\d+)$"),
    "output_connectors": re.compile(r"^to_stage_(\d+)$"),
}


@dataclass(frozen=True)
class CheckContext:
    file: str
    stages: list[tuple[int, StageConfig]]  # (index in stage_args, stage) for valid stages
    known_ids: frozenset[int]  # every stage_id written in the file, valid stage or not
    runtime: PipelineRuntime | None
    complete: bool  # every stage passed schema validation
    runtime_valid: bool = True  # top-level `runtime` passed schema validation
    # The model a stage that names none runs (known when the orchestrator starts, not at load).
    model: str | None = None

    def issue(
        self, stage: StageConfig | None, key: str, got: Any, allowed: str | None, message: str
    ) -> ConfigIssue:
        sid = None if stage is None else stage.stage_id
        return ConfigIssue(self.file, sid, key, got, allowed, message)


def _ek(index: int, rest: str) -> str:
    return f"stage_args[{index}].{rest}"


# --- graph --------------------------------------------------------------------------------------


def check_graph(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    known = sorted(ctx.known_ids)
    graph: dict[int, list[int]] = {sid: [] for sid in ctx.known_ids}
    for index, stage in ctx.stages:
        for src in stage.engine_input_source:
            key = _ek(index, "engine_input_source")
            if src == stage.stage_id:
                issues.append(ctx.issue(stage, key, src, "ids of other stages", "a stage cannot feed itself"))
            elif src not in ctx.known_ids:
                issues.append(
                    ctx.issue(
                        stage,
                        key,
                        src,
                        f"one of the stage ids {known}",
                        f"engine_input_source names stage {src}, which does not exist",
                    )
                )
            else:
                graph[src].append(stage.stage_id)
    if ctx.runtime is not None:
        for k, edge in enumerate(ctx.runtime.edges):
            ends_ok = True
            for end, value in (("from", edge.from_stage), ("to", edge.to_stage)):
                if value not in ctx.known_ids:
                    ends_ok = False
                    issues.append(
                        ctx.issue(
                            None,
                            f"runtime.edges[{k}].{end}",
                            value,
                            f"one of the stage ids {known}",
                            f"edge names stage {value}, which does not exist",
                        )
                    )
            if ends_ok and edge.from_stage == edge.to_stage:
                issues.append(
                    ctx.issue(
                        None,
                        f"runtime.edges[{k}]",
                        edge.from_stage,
                        "two different stage ids",
                        "an edge cannot connect a stage to itself",
                    )
                )
            elif ends_ok:
                graph[edge.from_stage].append(edge.to_stage)
    cycle = _find_cycle(graph)
    if cycle:
        path = " -> ".join(str(s) for s in cycle)
        issues.append(
            ctx.issue(
                None,
                "stage_args[*].engine_input_source / runtime.edges",
                path,
                "an acyclic stage graph",
                f"stages form a cycle: {path}",
            )
        )
    return issues


def _find_cycle(graph: dict[int, list[int]]) -> list[int] | None:
    """One cycle as [a, b, ..., a], or None. Iterative DFS with white/grey/black colouring."""
    colour = {node: 0 for node in graph}
    for start in sorted(graph):
        if colour[start]:
            continue
        stack: list[tuple[int, int]] = [(start, 0)]
        path: list[int] = [start]
        colour[start] = 1
        while stack:
            node, i = stack[-1]
            succ = graph[node]
            if i == len(succ):
                stack.pop()
                path.pop()
                colour[node] = 2
                continue
            stack[-1] = (node, i + 1)
            nxt = succ[i]
            if colour[nxt] == 1:
                return path[path.index(nxt) :] + [nxt]
            if colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, 0))
                path.append(nxt)
    return None


# --- per-stage rules ----------------------------------------------------------------------------


def check_stage_rules(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        args = stage.engine_args
        hf_stages = registry.hf_stages()
        if args.engine == "hf" and args.model_stage not in hf_stages:
            hint = suggest(args.model_stage, hf_stages)
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "engine_args.model_stage"),
                    args.model_stage,
                    ", ".join(sorted(hf_stages)),
                    "no registered model has an hf engine for this model stage"
                    + (f"; did you mean '{hint}'?" if hint else ""),
                )
            )
        if args.engine == "vllm":
            for key in sorted(args.model_fields_set & HF_ONLY_KEYS.keys()):
                issues.append(
                    ctx.issue(
                        stage,
                        _ek(index, f"engine_args.{key}"),
                        getattr(args, key),
                        f"remove it ({HF_ONLY_KEYS[key]})",
                        "only omni-pd's hf engine reads this key; this stage runs on engine: vllm",
                    )
                )
        if stage.custom_process_input_func and not stage.engine_input_source:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "custom_process_input_func"),
                    stage.custom_process_input_func,
                    "set engine_input_source too, or drop the function",
                    "an input processor needs source stages (engine_input_source is empty)",
                )
            )
        kv_params = stage.default_sampling_params.kv_transfer_params
        if kv_params is not None:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "default_sampling_params.kv_transfer_params"),
                    kv_params,
                    "remove it",
                    "kv_transfer_params are set per request by omni-pd's P/D planning, not in the file",
                )
            )
    return issues


def check_kv_extra_keys(ctx: CheckContext) -> list[ConfigIssue]:
    """kv_connector_extra_config passes unknown keys to the connector, so a misspelt omni-pd
    key would be silently ignored: flag unknown keys that look like one of ours."""
    issues: list[ConfigIssue] = []
    ours = KVConnectorExtraConfig.DECODE_GOVERNED_KEYS + ("kv_same_host",)
    for index, stage in ctx.stages:
        kv = stage.kv_transfer_config
        if kv is None:
            continue
        extra = kv.kv_connector_extra_config.model_extra or {}
        for key in extra:
            hint = suggest(key, ours)
            if hint is not None:
                issues.append(
                    ctx.issue(
                        stage,
                        _ek(index, f"engine_args.kv_transfer_config.kv_connector_extra_config.{key}"),
                        extra[key],
                        ", ".join(ours),
                        f"unknown key '{key}'; did you mean '{hint}'?",
                    )
                )
    return issues


def check_final_outputs(ctx: CheckContext) -> list[ConfigIssue]:
    if not ctx.complete or any(stage.final_output for _, stage in ctx.stages):
        return []
    return [
        ctx.issue(
            None,
            "stage_args[*].final_output",
            False,
            "true on at least one stage",
            "no stage produces a final output",
        )
    ]


def check_connectors(ctx: CheckContext) -> list[ConfigIssue]:
    if not ctx.runtime_valid:
        return []  # connector names cannot be checked against a runtime section that failed
    issues: list[ConfigIssue] = []
    declared = set(ctx.runtime.connectors) if ctx.runtime is not None else set()
    for index, stage in ctx.stages:
        for field, pattern in _CONNECTOR_KEY.items():
            for conn_key, conn_name in getattr(stage, field).items():
                key = _ek(index, f"{field}.{conn_key}")
                match = pattern.match(conn_key)
                if match is None:
                    expected = pattern.pattern.strip("^$").replace(r"(\d+)", "<stage_id>")
                    issues.append(ctx.issue(stage, key, conn_key, expected, "malformed connector key"))
                elif int(match.group(1)) not in ctx.known_ids:
                    issues.append(
                        ctx.issue(
                            stage,
                            key,
                            conn_key,
                            f"one of the stage ids {sorted(ctx.known_ids)}",
                            "connector key names a stage that does not exist",
                        )
                    )
                if conn_name not in declared:
                    issues.append(
                        ctx.issue(
                            stage,
                            key,
                            conn_name,
                            ", ".join(sorted(declared)) or "declare it under runtime.connectors",
                            f"connector '{conn_name}' is not declared under runtime.connectors",
                        )
                    )
    return issues


# --- imports ------------------------------------------------------------------------------------


def import_problem(dotted: str) -> str | None:
    """Why `dotted` ("pkg.mod.func") cannot be imported as a callable, or None if it can."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        return f"cannot import module '{module_name}' (module '{missing}' not found)"
    except Exception as exc:  # any import-time failure is a config problem worth reporting
        return f"importing module '{module_name}' failed: {type(exc).__name__}: {exc}"
    if not hasattr(module, attr):
        hint = suggest(attr, [n for n in dir(module) if not n.startswith("_")])
        return f"module '{module_name}' has no attribute '{attr}'" + (
            f"; did you mean '{hint}'?" if hint else ""
        )
    if not callable(getattr(module, attr)):
        return f"'{dotted}' is not callable"
    return None


def check_imports(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        func = stage.custom_process_input_func
        if func and (problem := import_problem(func)):
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "custom_process_input_func"),
                    func,
                    "an importable 'package.module.function'",
                    problem,
                )
            )
    return issues


# --- prefill / decode ---------------------------------------------------------------------------


def check_pd(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    prefill = [(i, s) for i, s in ctx.stages if s.is_prefill_only]
    decode = [(i, s) for i, s in ctx.stages if s.is_decode_only]
    for index, stage in ctx.stages:
        if stage.is_prefill_only and stage.is_decode_only:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "is_decode_only"),
                    True,
                    "set only one of is_prefill_only / is_decode_only",
                    "a stage cannot be both prefill-only and decode-only",
                )
            )
    for role, group in (("is_prefill_only", prefill), ("is_decode_only", decode)):
        if len(group) > 1:
            ids = [s.stage_id for _, s in group]
            for index, stage in group[1:]:
                issues.append(
                    ctx.issue(
                        stage,
                        _ek(index, role),
                        True,
                        f"{role}: true on one stage only",
                        f"more than one {role} stage ({ids}); omni-pd supports one prefill/decode pair",
                    )
                )
    if issues:
        return issues
    if ctx.complete and bool(prefill) != bool(decode):
        index, stage = (prefill or decode)[0]
        if prefill:
            key, message = "is_prefill_only", "prefill-only stage has no decode-only stage"
            allowed = f"add a stage with is_decode_only: true and engine_input_source: [{stage.stage_id}]"
        else:
            key, message = "is_decode_only", "decode-only stage has no prefill-only stage"
            allowed = "add a stage with is_prefill_only: true that feeds this stage"
        issues.append(ctx.issue(stage, _ek(index, key), True, allowed, message))
    if prefill and decode:
        issues.extend(_check_pair(ctx, prefill[0], decode[0]))
    return issues


def _check_pair(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append

    if ps.stage_id not in ds.engine_input_source:
        add(
            ctx.issue(
                ds,
                _ek(di, "engine_input_source"),
                list(ds.engine_input_source),
                f"a list containing {ps.stage_id}",
                f"decode stage must be fed by its prefill stage {ps.stage_id}",
            )
        )
    vllm_pair = ps.engine_args.engine == ds.engine_args.engine == "vllm"
    if vllm_pair:  # vLLM's connectors reshard KV heads between TP sizes: checked apart
        issues.extend(_check_pair_tp(ctx, p, d))
    engines = (ps.engine_args.engine, ds.engine_args.engine)
    mixed = engines == CROSS_ENGINE_PAIR
    if mixed:  # an unmodified vLLM prefill feeds hf decode (core/vllm_source.py)
        issues.extend(_check_cross_engine_pair(ctx, p, d))
    elif engines == REVERSE_CROSS_ENGINE_PAIR:  # hf prefill feeds unmodified vLLM decode (vllm_consumers.py)
        issues.extend(_check_reverse_cross_engine_pair(ctx, p, d))
    elif ps.engine_args.engine != ds.engine_args.engine:
        add(
            ctx.issue(
                ds,
                _ek(di, "engine_args.engine"),
                ds.engine_args.engine,
                f"{ps.engine_args.engine!r} (as prefill stage {ps.stage_id})",
                f"a {ps.engine_args.engine} prefill stage cannot feed a {ds.engine_args.engine} decode "
                "stage: across engines only vllm prefill -> hf decode and hf prefill -> vllm decode "
                "are supported (docs/cross_engine_pd.md)",
            )
        )
    if engines != REVERSE_CROSS_ENGINE_PAIR:
        for index, stage in ((pi, ps), (di, ds)):
            kv = stage.kv_transfer_config
            if kv is not None and kv.kv_connector_extra_config.serve_vllm_consumers:
                add(
                    ctx.issue(
                        stage,
                        f"{_ek(index, 'engine_args.kv_transfer_config')}.kv_connector_extra_config"
                        ".serve_vllm_consumers",
                        True,
                        "false (or unset)",
                        "only an hf prefill stage whose decode stage is engine vllm serves vLLM's "
                        f"consumers; this pair is {engines[0]} prefill -> {engines[1]} decode",
                    )
                )
    # A vLLM pair reshards between TP sizes (above); the vLLM -> hf pair checks TP apart (the hf
    # decode stage runs at TP 1, so what to change is the vLLM prefill's size). The hf -> vLLM
    # pair's sizes must be equal (its hf prefill writes one vLLM worker's blocks).
    for attr in ("model_stage",) + (() if vllm_pair or mixed else ("tensor_parallel_size",)):
        pv, dv = getattr(ps.engine_args, attr), getattr(ds.engine_args, attr)
        if pv != dv:
            add(
                ctx.issue(
                    ds,
                    _ek(di, f"engine_args.{attr}"),
                    dv,
                    repr(pv),
                    f"decode stage's {attr} differs from prefill stage {ps.stage_id}'s; "
                    "the KV cache can only move between identical layouts",
                )
            )

    issues.extend(_check_block_sizes(ctx, p, d))
    pkv, dkv = ps.kv_transfer_config, ds.kv_transfer_config
    for index, stage, kv, roles in ((pi, ps, pkv, PREFILL_ROLES), (di, ds, dkv, DECODE_ROLES)):
        side = "prefill" if stage is ps else "decode"
        base = _ek(index, "engine_args.kv_transfer_config")
        if kv is None:
            add(
                ctx.issue(
                    stage,
                    base,
                    None,
                    f"a mapping with kv_connector and kv_role ({' or '.join(sorted(roles))})",
                    f"{side} stage of a P/D pair needs a kv_transfer_config",
                )
            )
            continue
        if kv.kv_role not in roles:
            add(
                ctx.issue(
                    stage,
                    f"{base}.kv_role",
                    kv.kv_role,
                    " or ".join(sorted(roles)),
                    f"wrong kv_role for the {side} side of a P/D pair",
                )
            )
        if kv.kv_connector is None:
            add(
                ctx.issue(
                    stage,
                    f"{base}.kv_connector",
                    None,
                    "a connector name, e.g. MooncakeConnector",
                    "a P/D stage needs a kv_connector",
                )
            )
    if pkv is None or dkv is None:
        return issues

    dbase = _ek(di, "engine_args.kv_transfer_config")
    if pkv.kv_connector and dkv.kv_connector and pkv.kv_connector != dkv.kv_connector:
        add(
            ctx.issue(
                ds,
                f"{dbase}.kv_connector",
                dkv.kv_connector,
                repr(pkv.kv_connector),
                f"kv_connector differs from prefill stage {ps.stage_id}'s; "
                "both sides must use the same connector",
            )
        )
    if pkv.engine_id is not None and pkv.engine_id == dkv.engine_id:
        add(
            ctx.issue(
                ds,
                f"{dbase}.engine_id",
                dkv.engine_id,
                "an engine_id different from the prefill stage's (or omit it)",
                f"engine_id is shared with prefill stage {ps.stage_id}; each engine needs its own",
            )
        )
    issues.extend(_check_handoff_keys(ctx, p, d, pkv, dkv))
    mode = dkv.kv_connector_extra_config.transfer_mode
    if mode == "push" and (ps.engine != "hf" or ds.engine != "hf"):
        add(
            ctx.issue(
                ds,
                f"{dbase}.kv_connector_extra_config.transfer_mode",
                mode,
                "'pull' (or engine: hf on both stages of the pair)",
                "push writes into blocks an hf decode engine reserves; on a vLLM stage the KV "
                "moves through vLLM's connector, which omni-pd does not drive in push mode",
            )
        )
    insist = dkv.kv_connector_extra_config.kv_same_host
    if pkv.kv_connector_extra_config.kv_same_host == "off" and insist in ("shm", "cuda_ipc"):
        add(
            ctx.issue(
                ds,
                f"{dbase}.kv_connector_extra_config.kv_same_host",
                insist,
                "'auto' or 'off', or kv_same_host not 'off' on the prefill stage",
                f"the decode stage insists on the same-host path but prefill stage "
                f"{ps.stage_id} sets kv_same_host 'off' (its cache is not shared memory): "
                "every request's handoff would fail",
            )
        )
    for stage, index, kv in ((ps, pi, pkv), (ds, di, dkv)):
        if stage.engine == "hf" and kv.kv_buffer_device not in (None, "cpu", "cuda"):
            add(
                ctx.issue(
                    stage,
                    f"{_ek(index, 'engine_args.kv_transfer_config')}.kv_buffer_device",
                    kv.kv_buffer_device,
                    "'cpu', 'cuda', or unset",
                    "where Mooncake moves a GPU stage's KV from: 'cuda' (the GPU memory, "
                    "needs a CUDA build of Mooncake) or 'cpu' (a pinned host copy)",
                )
            )
    # Replica k of a stage listens on its port + k (config/replicas.py): the ranges must not meet.
    pports = _ports(pkv.bootstrap_port, ps.runtime.num_replicas)
    dports = _ports(dkv.bootstrap_port, ds.runtime.num_replicas)
    if pports & dports:
        port_key = (
            "kv_connector_extra_config.mooncake_bootstrap_port"
            if dkv.kv_connector_extra_config.mooncake_bootstrap_port is not None
            else "kv_port"
        )
        add(
            ctx.issue(
                ds,
                f"{dbase}.{port_key}",
                dkv.bootstrap_port,
                "a port different from the prefill stage's"
                + (" and its replicas' (port + replica index)" if len(pports) > 1 else ""),
                f"bootstrap port is shared with prefill stage {ps.stage_id}",
            )
        )
    return issues


CROSS_ENGINE_PAIR = ("vllm", "hf")  # (prefill engine, decode engine): the mixed pairs
REVERSE_CROSS_ENGINE_PAIR = ("hf", "vllm")


def _check_cross_engine_pair(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """A vLLM prefill stage and an hf decode stage share one block size (vLLM's block_size, the
    hf stage's kv_block_size) and one block-key algorithm (prefix_caching_hash_algo: the hf
    stage names the blocks it reads by vLLM's keys)."""
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    ptp = ps.engine_args.tensor_parallel_size
    if ptp != ds.engine_args.tensor_parallel_size == 1:
        issues.append(
            ctx.issue(
                ps,
                _ek(pi, "engine_args.tensor_parallel_size"),
                ptp,
                f"1 (as hf decode stage {ds.stage_id}), or a vLLM decode stage to keep TP {ptp}",
                f"vLLM prefill stage {ps.stage_id} runs tensor_parallel_size {ptp} but feeds hf "
                f"decode stage {ds.stage_id}, which reads one vLLM rank's whole KV cache: the hf "
                "engine runs a stage on one device and does not reshard KV heads between ranks",
            )
        )
    vllm_block = ps.engine_args.block_size
    if vllm_block is None or vllm_block != ds.engine_args.kv_block_size:
        issues.append(
            ctx.issue(
                ds,
                _ek(di, "engine_args.kv_block_size"),
                ds.engine_args.kv_block_size,
                f"{vllm_block} (vLLM prefill stage {ps.stage_id}'s block_size)"
                if vllm_block is not None
                else "the vLLM prefill stage's block_size (set block_size there, a multiple of 32 on CPU)",
                f"the hf decode stage's kv_block_size {ds.engine_args.kv_block_size} and vLLM prefill "
                f"stage {ps.stage_id}'s block_size {vllm_block} must be equal: vLLM's blocks are "
                "translated into the hf engine's one for one",
            )
        )
    vllm_algo = ps.engine_args.prefix_caching_hash_algo or "sha256"  # vLLM 0.32's default
    if ds.engine_args.prefix_caching_hash_algo != vllm_algo:
        issues.append(
            ctx.issue(
                ds,
                _ek(di, "engine_args.prefix_caching_hash_algo"),
                ds.engine_args.prefix_caching_hash_algo,
                repr(vllm_algo),
                f"the hf decode stage names the blocks it reads from vLLM prefill stage "
                f"{ps.stage_id} by vLLM's keys: its prefix_caching_hash_algo must be vLLM's "
                f"({vllm_algo!r})",
            )
        )
    return issues


def _check_reverse_cross_engine_pair(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """An hf prefill stage feeding a vLLM decode stage serves vLLM's consumers
    (serve_vllm_consumers), and the two share one block size (the hf stage's kv_block_size,
    vLLM's block_size: the hf blocks are translated into vLLM's one for one) and one block-key
    algorithm (prefix_caching_hash_algo)."""
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    pkv = ps.kv_transfer_config
    if pkv is not None and not pkv.kv_connector_extra_config.serve_vllm_consumers:
        issues.append(
            ctx.issue(
                ps,
                _ek(pi, "engine_args.kv_transfer_config.kv_connector_extra_config.serve_vllm_consumers"),
                False,
                "true",
                f"hf prefill stage {ps.stage_id} feeds vLLM decode stage {ds.stage_id}: it must serve "
                "vLLM's MooncakeConnector consumers (set serve_vllm_consumers: true)",
            )
        )
    vllm_block = ds.engine_args.block_size
    if vllm_block is None or vllm_block != ps.engine_args.kv_block_size:
        issues.append(
            ctx.issue(
                ds,
                _ek(di, "engine_args.block_size"),
                vllm_block,
                f"{ps.engine_args.kv_block_size} (hf prefill stage {ps.stage_id}'s kv_block_size, "
                "a multiple of 32 on CPU)",
                f"vLLM decode stage {ds.stage_id}'s block_size {vllm_block} and hf prefill stage "
                f"{ps.stage_id}'s kv_block_size {ps.engine_args.kv_block_size} must be equal: the hf "
                "blocks are translated into vLLM's one for one",
            )
        )
    vllm_algo = ds.engine_args.prefix_caching_hash_algo or "sha256"  # vLLM 0.32's default
    if ps.engine_args.prefix_caching_hash_algo != vllm_algo:
        issues.append(
            ctx.issue(
                ps,
                _ek(pi, "engine_args.prefix_caching_hash_algo"),
                ps.engine_args.prefix_caching_hash_algo,
                repr(vllm_algo),
                f"the hf prefill stage's block keys (prefix_caching_hash_algo "
                f"{ps.engine_args.prefix_caching_hash_algo!r}) must be vLLM decode stage "
                f"{ds.stage_id}'s ({vllm_algo!r}), so that both name a prompt's blocks alike",
            )
        )
    return issues


def _check_block_sizes(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """hf legs may page their caches in different block sizes when one divides the other: a
    block of the larger size is whole blocks of the smaller (a pull converts through staging, a
    push writes each block's token range straight into the peer's)."""
    (_, ps), (di, ds) = p, d
    if ps.engine != "hf" or ds.engine != "hf":
        return []
    pb, db = ps.engine_args.kv_block_size, ds.engine_args.kv_block_size
    if pb % db == 0 or db % pb == 0:
        return []
    return [
        ctx.issue(
            ds,
            _ek(di, "engine_args.kv_block_size"),
            db,
            f"a divisor or multiple of prefill stage {ps.stage_id}'s kv_block_size {pb} "
            f"(e.g. {pb} or {2 * pb})",
            f"decode stage's kv_block_size {db} and prefill stage {ps.stage_id}'s {pb} do not "
            "divide one another: a block of one would straddle blocks of the other; set either "
            "stage's kv_block_size so that one divides the other",
        )
    ]


def _kv_heads(stage: StageConfig, default_model: str | None) -> int | None:
    """The KV head count of a stage's model (its own `model`, else the pipeline's when known),
    when the model is a checkpoint directory or an embedded model; None when only vLLM can tell."""
    model = stage.engine_args.model or default_model
    return registry.text_kv_heads(model) if model else None


def _check_pair_tp(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """A vLLM pair may differ in tensor_parallel_size (vLLM's MooncakeConnector maps the ranks
    and reshards the KV heads) when one size divides the other and each side's ranks hold whole
    KV heads (or whole copies of them)."""
    (pi, ps), (di, ds) = p, d
    ptp, dtp = ps.engine_args.tensor_parallel_size, ds.engine_args.tensor_parallel_size
    issues: list[ConfigIssue] = []
    if max(ptp, dtp) % min(ptp, dtp):
        issues.append(
            ctx.issue(
                ds,
                _ek(di, "engine_args.tensor_parallel_size"),
                dtp,
                f"a divisor or a multiple of prefill stage {ps.stage_id}'s {ptp}",
                f"neither the prefill ({ptp}) nor the decode ({dtp}) tensor_parallel_size divides "
                "the other; the KV connector maps ranks only when one does",
            )
        )
    heads = _kv_heads(ds, ctx.model) or _kv_heads(ps, ctx.model)
    if heads is None or ptp == dtp == 1:
        return issues
    for index, stage, tp in ((pi, ps, ptp), (di, ds, dtp)):
        if heads % tp and tp % heads:
            divisors = [n for n in range(1, heads + 1) if heads % n == 0]
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "engine_args.tensor_parallel_size"),
                    tp,
                    f"a divisor of {heads} ({', '.join(map(str, divisors))}) or a multiple of it",
                    f"the model's {heads} KV heads do not split over {tp} ranks: each rank must hold "
                    "whole KV heads (or whole copies of them) for the KV cache to move between the "
                    "prefill and decode stages",
                )
            )
    return issues


def _ports(first: int | None, replicas: int) -> set[int]:
    return set() if first is None else set(range(first, first + replicas))


def _check_handoff_keys(
    ctx: CheckContext,
    p: tuple[int, StageConfig],
    d: tuple[int, StageConfig],
    pkv: KVTransferConfig,
    dkv: KVTransferConfig,
) -> list[ConfigIssue]:
    """The decode stage's handoff keys govern the pair: a prefill stage may repeat them, not
    contradict them (a reader of the prefill stage would believe the wrong value)."""
    (pi, ps), (_, ds) = p, d
    pextra, dextra = pkv.kv_connector_extra_config, dkv.kv_connector_extra_config
    issues = []
    for key in KVConnectorExtraConfig.DECODE_GOVERNED_KEYS:
        pv, dv = getattr(pextra, key), getattr(dextra, key)
        if key in pextra.model_fields_set and pv != dv:
            source = "sets" if key in dextra.model_fields_set else "uses the default"
            issues.append(
                ctx.issue(
                    ps,
                    _ek(pi, f"engine_args.kv_transfer_config.kv_connector_extra_config.{key}"),
                    pv,
                    f"{dv!r} (decode stage {ds.stage_id}'s value), or remove it here",
                    f"{key} differs between prefill stage {ps.stage_id} ({pv!r}) and decode stage "
                    f"{ds.stage_id}, which {source} {dv!r}; the decode stage's value governs the "
                    "handoff: set it there",
                )
            )
    return issues


def check_replicas(ctx: CheckContext) -> list[ConfigIssue]:
    """Replicas share the stage's `runtime.devices` out, tensor_parallel_size each."""
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        replicas, devices = stage.runtime.num_replicas, stage.runtime.devices
        if replicas == 1 or not devices:
            continue
        tp = stage.engine_args.tensor_parallel_size
        have = len([d for d in devices.split(",") if d.strip()])
        if have < replicas * tp:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "runtime.num_replicas"),
                    replicas,
                    f"at most {have // tp} with these devices, or list {replicas * tp} devices",
                    f"{replicas} replicas of tensor_parallel_size {tp} need {replicas * tp} devices, "
                    f"but runtime.devices lists {have} ({devices!r})",
                )
            )
    return issues


# How a stage's workers run: a local process ("mp", the default) or a Ray actor ("ray").
WORKER_BACKENDS = ("mp", "ray")


def check_worker_backend(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        backend = stage.engine_args.distributed_executor_backend
        # vLLM stages hand the key on to vLLM too (its own executor: uni, mp, ray, ...).
        if stage.engine == "hf" and backend is not None and backend not in WORKER_BACKENDS:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "engine_args.distributed_executor_backend"),
                    backend,
                    "mp (a local worker process) or ray (a Ray actor)",
                    "omni-pd runs each stage worker as a local process or a Ray actor",
                )
            )
        if backend == "ray" and not stage.runtime.process:
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "runtime.process"),
                    False,
                    "true, or drop the ray backend",
                    "a Ray actor is a process of its own; an in-process stage cannot be one",
                )
            )
        if stage.runtime.ray_resources and backend != "ray":
            issues.append(
                ctx.issue(
                    stage,
                    _ek(index, "runtime.ray_resources"),
                    dict(stage.runtime.ray_resources),
                    "distributed_executor_backend: ray on this stage, or remove ray_resources",
                    "Ray resources place Ray actors; this stage runs as a local process",
                )
            )
    return issues


ALL_CHECKS: tuple[Callable[[CheckContext], list[ConfigIssue]], ...] = (
    check_graph,
    check_stage_rules,
    check_kv_extra_keys,
    check_final_outputs,
    check_connectors,
    check_pd,
    check_replicas,
    check_worker_backend,
)


def run_checks(ctx: CheckContext, *, imports: bool = True) -> list[ConfigIssue]:
    issues = [issue for check in ALL_CHECKS for issue in check(ctx)]
    if imports:
        issues.extend(check_imports(ctx))
    return issues
