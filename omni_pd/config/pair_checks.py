"""The P/D pair's checks: one prefill-only and one decode-only stage, fed one from the other,
with matching layouts, KV connectors, roles, ports and handoff keys. The cross-engine pairs'
rules are in cross_engine_checks.py, a vLLM pair's tensor-parallel rules in tp_checks.py."""

from __future__ import annotations

from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.cross_engine_checks import (
    CROSS_ENGINE_PAIR,
    REVERSE_CROSS_ENGINE_PAIR,
    check_cross_engine_pair,
    check_reverse_cross_engine_pair,
)
from omni_pd.config.errors import ConfigIssue
from omni_pd.config.schema import KVConnectorExtraConfig, KVTransferConfig, StageConfig
from omni_pd.config.tp_checks import check_pair_tp

PREFILL_ROLES: frozenset[str] = frozenset({"kv_producer", "kv_both"})
DECODE_ROLES: frozenset[str] = frozenset({"kv_consumer", "kv_both"})


def check_pd(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    prefill = [(i, s) for i, s in ctx.stages if s.is_prefill_only]
    decode = [(i, s) for i, s in ctx.stages if s.is_decode_only]
    for index, stage in ctx.stages:
        if stage.is_prefill_only and stage.is_decode_only:
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "is_decode_only"),
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
                        stage_key(index, role),
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
        issues.append(ctx.issue(stage, stage_key(index, key), True, allowed, message))
    if prefill and decode:
        issues.extend(_check_pair(ctx, prefill[0], decode[0]))
    return issues


def _check_pair(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    issues = [
        *_check_fed_by_prefill(ctx, p, d),
        *_check_engines(ctx, p, d),
        *_check_layouts(ctx, p, d),
        *_check_block_sizes(ctx, p, d),
        *_check_kv_transfer_configs(ctx, p, d),
    ]
    pkv, dkv = p[1].kv_transfer_config, d[1].kv_transfer_config
    if pkv is None or dkv is None:
        return issues
    return [
        *issues,
        *_check_connector_and_engine_id(ctx, p, d, pkv, dkv),
        *_check_handoff_keys(ctx, p, d, pkv, dkv),
        *_check_transfer_paths(ctx, p, d, pkv, dkv),
        *_check_ports(ctx, p, d, pkv, dkv),
    ]


def _check_fed_by_prefill(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """The decode stage takes its input from its prefill stage."""
    (_, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    if ps.stage_id not in ds.engine_input_source:
        add(
            ctx.issue(
                ds,
                stage_key(di, "engine_input_source"),
                list(ds.engine_input_source),
                f"a list containing {ps.stage_id}",
                f"decode stage must be fed by its prefill stage {ps.stage_id}",
            )
        )
    return issues


def _check_engines(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """Which engines may pair: equal ones, or a cross-engine pair with its own rules; only an
    hf prefill feeding vLLM decode serves vLLM's consumers."""
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    vllm_pair = ps.engine_args.engine == ds.engine_args.engine == "vllm"
    if vllm_pair:  # vLLM's connectors reshard KV heads between TP sizes: checked apart
        issues.extend(check_pair_tp(ctx, p, d))
    engines = (ps.engine_args.engine, ds.engine_args.engine)
    mixed = engines == CROSS_ENGINE_PAIR
    if mixed:  # an unmodified vLLM prefill feeds hf decode (core/vllm_source.py)
        issues.extend(check_cross_engine_pair(ctx, p, d))
    elif engines == REVERSE_CROSS_ENGINE_PAIR:  # hf prefill feeds unmodified vLLM decode (vllm_consumers.py)
        issues.extend(check_reverse_cross_engine_pair(ctx, p, d))
    elif ps.engine_args.engine != ds.engine_args.engine:
        add(
            ctx.issue(
                ds,
                stage_key(di, "engine_args.engine"),
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
                        f"{stage_key(index, 'engine_args.kv_transfer_config')}.kv_connector_extra_config"
                        ".serve_vllm_consumers",
                        True,
                        "false (or unset)",
                        "only an hf prefill stage whose decode stage is engine vllm serves vLLM's "
                        f"consumers; this pair is {engines[0]} prefill -> {engines[1]} decode",
                    )
                )
    return issues


def _check_layouts(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """The KV layout both stages share: model stage and (where no connector reshards) TP size."""
    (_, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    engines = (ps.engine_args.engine, ds.engine_args.engine)
    # A vLLM pair reshards between TP sizes (check_pair_tp); the vLLM -> hf pair checks TP apart
    # (the hf decode stage runs at TP 1, so what to change is the vLLM prefill's size). The hf ->
    # vLLM pair's sizes must be equal (its hf prefill writes one vLLM worker's blocks).
    vllm_pair, mixed = engines == ("vllm", "vllm"), engines == CROSS_ENGINE_PAIR
    for attr in ("model_stage",) + (() if vllm_pair or mixed else ("tensor_parallel_size",)):
        pv, dv = getattr(ps.engine_args, attr), getattr(ds.engine_args, attr)
        if pv != dv:
            add(
                ctx.issue(
                    ds,
                    stage_key(di, f"engine_args.{attr}"),
                    dv,
                    repr(pv),
                    f"decode stage's {attr} differs from prefill stage {ps.stage_id}'s; "
                    "the KV cache can only move between identical layouts",
                )
            )
    return issues


def _check_kv_transfer_configs(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """Each side has a kv_transfer_config with a connector and a role for its side."""
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    pkv, dkv = ps.kv_transfer_config, ds.kv_transfer_config
    for index, stage, kv, roles in ((pi, ps, pkv, PREFILL_ROLES), (di, ds, dkv, DECODE_ROLES)):
        side = "prefill" if stage is ps else "decode"
        base = stage_key(index, "engine_args.kv_transfer_config")
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
    return issues


def _check_connector_and_engine_id(
    ctx: CheckContext,
    p: tuple[int, StageConfig],
    d: tuple[int, StageConfig],
    pkv: KVTransferConfig,
    dkv: KVTransferConfig,
) -> list[ConfigIssue]:
    """One connector for both sides, and an engine_id each."""
    (_, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    dbase = stage_key(di, "engine_args.kv_transfer_config")
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
    return issues


def _check_transfer_paths(
    ctx: CheckContext,
    p: tuple[int, StageConfig],
    d: tuple[int, StageConfig],
    pkv: KVTransferConfig,
    dkv: KVTransferConfig,
) -> list[ConfigIssue]:
    """Push mode, the same-host path and the buffer device: what each needs of the pair."""
    (pi, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    dbase = stage_key(di, "engine_args.kv_transfer_config")
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
                    f"{stage_key(index, 'engine_args.kv_transfer_config')}.kv_buffer_device",
                    kv.kv_buffer_device,
                    "'cpu', 'cuda', or unset",
                    "where Mooncake moves a GPU stage's KV from: 'cuda' (the GPU memory, "
                    "needs a CUDA build of Mooncake) or 'cpu' (a pinned host copy)",
                )
            )
    return issues


def _check_ports(
    ctx: CheckContext,
    p: tuple[int, StageConfig],
    d: tuple[int, StageConfig],
    pkv: KVTransferConfig,
    dkv: KVTransferConfig,
) -> list[ConfigIssue]:
    """Replica k of a stage listens on its port + k (config/replicas.py): the ranges must not meet."""
    (_, ps), (di, ds) = p, d
    issues: list[ConfigIssue] = []
    add = issues.append
    dbase = stage_key(di, "engine_args.kv_transfer_config")
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
            stage_key(di, "engine_args.kv_block_size"),
            db,
            f"a divisor or multiple of prefill stage {ps.stage_id}'s kv_block_size {pb} "
            f"(e.g. {pb} or {2 * pb})",
            f"decode stage's kv_block_size {db} and prefill stage {ps.stage_id}'s {pb} do not "
            "divide one another: a block of one would straddle blocks of the other; set either "
            "stage's kv_block_size so that one divides the other",
        )
    ]


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
                    stage_key(pi, f"engine_args.kv_transfer_config.kv_connector_extra_config.{key}"),
                    pv,
                    f"{dv!r} (decode stage {ds.stage_id}'s value), or remove it here",
                    f"{key} differs between prefill stage {ps.stage_id} ({pv!r}) and decode stage "
                    f"{ds.stage_id}, which {source} {dv!r}; the decode stage's value governs the "
                    "handoff: set it there",
                )
            )
    return issues
