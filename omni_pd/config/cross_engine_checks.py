"""The mixed P/D pairs' checks: an unmodified vLLM prefill feeding hf decode, and an hf prefill
feeding unmodified vLLM decode (docs/cross_engine_pd.md)."""

from __future__ import annotations

from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.errors import ConfigIssue
from omni_pd.config.schema import StageConfig

CROSS_ENGINE_PAIR = ("vllm", "hf")  # (prefill engine, decode engine): the mixed pairs
REVERSE_CROSS_ENGINE_PAIR = ("hf", "vllm")


def check_cross_engine_pair(
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
                stage_key(pi, "engine_args.tensor_parallel_size"),
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
                stage_key(di, "engine_args.kv_block_size"),
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
                stage_key(di, "engine_args.prefix_caching_hash_algo"),
                ds.engine_args.prefix_caching_hash_algo,
                repr(vllm_algo),
                f"the hf decode stage names the blocks it reads from vLLM prefill stage "
                f"{ps.stage_id} by vLLM's keys: its prefix_caching_hash_algo must be vLLM's "
                f"({vllm_algo!r})",
            )
        )
    return issues


def check_reverse_cross_engine_pair(
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
                stage_key(
                    pi, "engine_args.kv_transfer_config.kv_connector_extra_config.serve_vllm_consumers"
                ),
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
                stage_key(di, "engine_args.block_size"),
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
                stage_key(pi, "engine_args.prefix_caching_hash_algo"),
                ps.engine_args.prefix_caching_hash_algo,
                repr(vllm_algo),
                f"the hf prefill stage's block keys (prefix_caching_hash_algo "
                f"{ps.engine_args.prefix_caching_hash_algo!r}) must be vLLM decode stage "
                f"{ds.stage_id}'s ({vllm_algo!r}), so that both name a prompt's blocks alike",
            )
        )
    return issues
