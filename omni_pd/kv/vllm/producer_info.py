"""A vLLM producer's KV as a non-vLLM decode engine needs to know it (kv/vllm/handoff.py); the
same for a vLLM consumer, checked against an hf producer's.

Read once, after start-up, from what vLLM's MooncakeConnector worker registered in this process
(the engine runs in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`): its layer names and indices,
the per-layer KV tensor's shape (vLLM's CPU layout `[blocks, kv_heads, block_size, 2 *
head_size]`), its dtype, the CPU attention kernel the model's attention layers picked (it decides
how K is packed), and the cache's `prefix_caching_hash_algo` with this process's NONE_HASH seed
rule. Logged at INFO as the producer's fingerprint.
"""

from __future__ import annotations

import json
import logging
import os

from .handoff import VllmProducerInfo, seed_rule
from .layout import VllmKVGeometry

log = logging.getLogger(__name__)


def _attention_isa(llm_engine) -> str:
    """The CPU attention kernel vLLM picked for the model's attention layers (`layer.isa`);
    "none" off CPU (where no translation exists)."""
    layers = llm_engine.vllm_config.compilation_config.static_forward_context.values()
    isas = {layer.isa for layer in layers if hasattr(layer, "isa")}
    return isas.pop() if len(isas) == 1 else "none"


def producer_info(llm_engine, model: str) -> VllmProducerInfo:
    from vllm import __version__ as version
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker  # type: ignore[attr-defined]  # MooncakeConnector
    first = next(iter(worker.device_kv_caches.values()))
    _, heads, block_size, channels = first.shape
    geometry = VllmKVGeometry(
        layer_names=tuple(worker.registered_layer_names),
        layer_indices=tuple(int(i) for i in worker.registered_layer_indices),
        block_size=int(block_size),
        num_kv_heads=int(heads),
        head_size=int(channels) // 2,
        dtype=str(first.dtype).removeprefix("torch."),  # type: ignore[arg-type]
        attention_isa=_attention_isa(llm_engine),
    )
    algo = str(llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    return VllmProducerInfo(
        geometry, algo, seed_rule(algo, os.environ.get("PYTHONHASHSEED")), model, str(version)
    )


def log_producer_info(stage_id: int, info: VllmProducerInfo, role: str = "prefill") -> None:
    """The engine's KV fingerprint (a consumer's too: `role` "decode"), for an operator to diff
    against the other side's."""
    log.info(
        "stage %d: vLLM %s engine KV fingerprint %s",
        stage_id,
        role,
        json.dumps(info.to_dict(), sort_keys=True),
    )
