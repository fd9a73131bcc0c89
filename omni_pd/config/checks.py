"""Rules that span keys or stages: ids, the stage graph, imports, connectors; and every check in
the order the loader runs them (`run_checks`). The P/D pair's checks are in pair_checks.py, where
a stage's workers run in worker_checks.py, their CPUs in cpu_checks.py.

Each check takes the stages that passed schema validation (with their index in `stage_args`)
and returns issues; none raises, so the loader can report everything at once. When some stages
failed schema validation (`complete=False`), checks that would need them are skipped rather than
reporting misleading follow-on errors.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

from omni_pd import registry
from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.cpu_checks import check_cpus
from omni_pd.config.errors import ConfigIssue
from omni_pd.config.pair_checks import check_pd
from omni_pd.config.pydantic_issues import suggest
from omni_pd.config.scheduler_checks import check_step_budget
from omni_pd.config.schema import KVConnectorExtraConfig
from omni_pd.config.worker_checks import check_replicas, check_worker_backend

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
_CONNECTOR_KEY = {
    "input_connectors": re.compile(r"^from_stage_(\d+)$"),
    "output_connectors": re.compile(r"^to_stage_(\d+)$"),
}


# --- graph --------------------------------------------------------------------------------------


def check_graph(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    known = sorted(ctx.known_ids)
    graph: dict[int, list[int]] = {sid: [] for sid in ctx.known_ids}
    for index, stage in ctx.stages:
        for src in stage.engine_input_source:
            key = stage_key(index, "engine_input_source")
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
                    stage_key(index, "engine_args.model_stage"),
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
                        stage_key(index, f"engine_args.{key}"),
                        getattr(args, key),
                        f"remove it ({HF_ONLY_KEYS[key]})",
                        "only omni-pd's hf engine reads this key; this stage runs on engine: vllm",
                    )
                )
        if stage.custom_process_input_func and not stage.engine_input_source:
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "custom_process_input_func"),
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
                    stage_key(index, "default_sampling_params.kv_transfer_params"),
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
                        stage_key(index, f"engine_args.kv_transfer_config.kv_connector_extra_config.{key}"),
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
                key = stage_key(index, f"{field}.{conn_key}")
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
                    stage_key(index, "custom_process_input_func"),
                    func,
                    "an importable 'package.module.function'",
                    problem,
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
    check_step_budget,
    check_cpus,
)


def run_checks(ctx: CheckContext, *, imports: bool = True) -> list[ConfigIssue]:
    issues = [issue for check in ALL_CHECKS for issue in check(ctx)]
    if imports:
        issues.extend(check_imports(ctx))
    return issues
