"""The hf prefill leg's vLLM decode peers: an unmodified vLLM decode engine (MooncakeConnector,
`kv_role: kv_consumer`) reads the prompt KV this leg prefilled, over vLLM's own protocol
(kv/vllm/serve.py), translated into vLLM's CPU layout (kv/vllm/layout.py).

Chosen by the stage's `kv_connector_extra_config.serve_vllm_consumers: true` (the config check
asks for it on an hf prefill stage paired with a vLLM decode stage, and only there). At start-up
the leg logs its KV fingerprint in vLLM's producer shape (kv/vllm/handoff.py), registers staging
for as many blocks as its paged cache holds and starts the bootstrap and side-channel servers.
Per request `offer` translates the prompt's blocks into staging (byte checked) under a lease of
`kv_lease_timeout_s`, and the request's own blocks go back to the engine (its prefix cache keeps
the full ones). `kv_params` is what the prefill output carries: vLLM's keys
(`remote_engine_id`, `remote_bootstrap_addr`, `transfer_id`, the direction flags), omni-pd's
(first token, the runner's handoff state, `kv_cacheable`) and `omni_pd_hf_kv`, which omni-pd's
vLLM decode engine checks against its own at the first handoff.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ... import faults
from ..transport import KVTransport
from .handoff import HF_KV_KEY, hf_producer_info
from .serve import VllmKVServer

log = logging.getLogger(__name__)


class VllmConsumers:
    def __init__(
        self,
        stage_id: int,
        engine_id: str,
        layout,
        transport: KVTransport,
        naming_scheme: str,
        naming_seed: str,
        model: str,
        staging_blocks: int,
        lease_timeout_s: float,
    ):
        self.stage_id = stage_id
        self.info = hf_producer_info(layout, naming_scheme, naming_seed, model)
        log.info(
            "stage %d: hf prefill engine KV fingerprint for vLLM consumers %s",
            stage_id,
            json.dumps(self.info.to_dict(), sort_keys=True),
        )
        self.server = VllmKVServer(
            transport,
            self.info.geometry,
            staging_blocks,
            engine_id,
            lease_timeout_s,
            host=transport.host,
        )

    def offer(self, transfer_id: str, fused: torch.Tensor, blocks: list[int]) -> dict[str, Any]:
        """Hold the prompt's blocks for the vLLM consumer that asks for `transfer_id`; the keys
        that tell it where (the caller adds its own)."""
        refuse = faults.take("vllm.serve.refuse") is not None  # test-only; False unless armed
        offer = self.server.offer(
            transfer_id,
            fused,
            blocks,
            refuse="refused by a test hook (vllm.serve.refuse)" if refuse else None,
        )
        # Test-only (omni_pd/faults.py): one staged block perturbed, every layer, after its
        # (checked) translation, as a fault in transit would be: vLLM's protocol carries no
        # checksum, so only the output can show it.
        fault = faults.take("vllm.serve.perturb")
        if fault is not None:
            block, delta = fault["block_index"], fault["delta"]
            for layer in self.server.layers:
                layer[offer.staging[block]] += delta
            log.warning("transfer %s: perturbed staged block %d by %g (test hook)", transfer_id, block, delta)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.server.engine_id,
            "remote_bootstrap_addr": self.server.bootstrap.address,
            HF_KV_KEY: self.info.to_dict(),
        }

    def release(self, transfer_id: str) -> bool:
        return self.server.release(transfer_id)

    def expire(self) -> None:
        self.server.expire()

    def stats(self) -> dict[str, Any]:
        stats = self.server.stats
        return {"sends": stats.sends, "blocks_sent": stats.blocks_sent, "refusals": list(stats.refusals)}

    def debug_state_counts(self) -> dict[str, int]:
        return self.server.debug_state_counts()

    def close(self) -> None:
        self.server.close()
