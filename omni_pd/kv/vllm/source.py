"""The hf decode leg's second KV source: an unmodified vLLM prefill engine (MooncakeConnector
producer), read over vLLM's own protocol (kv/vllm/pull.py) and translated into the request's
blocks (kv/vllm/layout.py).

A request whose kv_transfer_params carry `omni_pd_vllm_kv` (kv/vllm/handoff.py) comes from such
a producer. At its first handoff the producer's geometry and block keys are checked against this
engine's (`check_consumer`: refused with both values named); the staging memory, one region per
vLLM layer, is made then, for that geometry, and registered once with the decode leg's Mooncake
transport. A request asks for the last blocks of its prompt that the prefix cache (named by
vLLM's keys) does not hold: only those move. When they are in staging they are translated, byte
checked, into the request's own blocks and staging is given back; a request that leaves while
its pull runs leaves its staging quarantined until the producer's answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ... import faults
from ..errors import KVIncompatibleError
from ..layout import BlockLayout
from ..transport import KVTransport
from .handoff import (
    VLLM_KV_KEY,
    VllmProducerInfo,
    check_consumer,
    check_protocol_version,
    consumer_fingerprint,
)
from .layout import translate_blocks
from .pull import VllmKVPuller, VllmPull

log = logging.getLogger(__name__)


def from_vllm(kv_params: dict[str, Any] | None) -> bool:
    """Whether a decode request's KV comes from a vLLM producer."""
    return bool(kv_params) and VLLM_KV_KEY in kv_params  # type: ignore[operator]


class VllmKVSource:
    def __init__(
        self,
        stage_id: int,
        layout: BlockLayout,
        transport: KVTransport,
        naming_scheme: str,
        naming_seed: str,
        model: str,
        staging_blocks: int,
    ):
        self.stage_id, self.layout, self.transport = stage_id, layout, transport
        self.naming_scheme, self.naming_seed = naming_scheme, naming_seed
        self.staging_blocks = staging_blocks
        self.fingerprint = consumer_fingerprint(layout, naming_scheme, naming_seed, model)
        self.producer: VllmProducerInfo | None = None  # the producer accepted at the first handoff
        self.puller: VllmKVPuller | None = None

    def log_fingerprint(self) -> None:
        log.info(
            "stage %d: hf decode engine KV fingerprint for vLLM producers %s",
            self.stage_id,
            json.dumps(self.fingerprint, sort_keys=True),
        )

    def accept(self, kv_params: dict[str, Any]) -> VllmProducerInfo:
        """The request's producer, checked against this engine (once per producer description)."""
        info = VllmProducerInfo.from_dict(kv_params[VLLM_KV_KEY])
        if info == self.producer:
            return info
        check_protocol_version(info.vllm_version, "vLLM prefill engine")
        check_consumer(info, self.layout, self.naming_scheme, self.naming_seed)
        if self.producer is not None and info.geometry != self.producer.geometry:
            raise KVIncompatibleError(
                f"stage {self.stage_id}: a vLLM producer with KV geometry {info.geometry.to_dict()} "
                f"after one with {self.producer.geometry.to_dict()}: this decode engine's staging "
                "memory is laid out for the first; give every vLLM prefill engine the same model "
                "and block size"
            )
        if self.puller is None:
            self.puller = VllmKVPuller(self.transport, info.geometry, self.staging_blocks)
            log.info(
                "stage %d: vLLM producer accepted (%s blocks, %s); %d staging blocks registered",
                self.stage_id,
                info.hash_algo,
                info.geometry.attention_isa,
                self.staging_blocks,
            )
        self.producer = info
        return info

    @property
    def fault_pending(self) -> bool:
        """A test has armed the vllm.pull.perturb fault hook (omni_pd/faults.py) for the next pull."""
        return faults.armed("vllm.pull.perturb")

    def free_staging(self) -> int:
        return self.staging_blocks - self.debug_state_counts()["kv.vllm_staging_blocks_held"]

    def start(self, kv_params: dict[str, Any], num_blocks: int, wait_s: float) -> VllmPull:
        assert self.puller is not None, "accept() ran at the request's check"
        query_s = wait_s  # the bootstrap query's bound, even when a test hook zeroes the wait
        if faults.take("vllm.pull.miss") is not None:  # test-only: this pull misses its window
            wait_s = 0.0
        return self.puller.start_at(
            kv_params["transfer_id"],
            kv_params["remote_bootstrap_addr"],
            kv_params["remote_engine_id"],
            num_blocks,
            wait_s,
            query_s,
        )

    def release_producer(self, kv_params: dict[str, Any], wait_s: float) -> None:
        """The prefix cache holds the whole prompt: tell the producer to free its blocks now."""
        assert self.puller is not None, "accept() ran at the request's check"
        self.puller.release_at(
            kv_params["transfer_id"],
            kv_params["remote_bootstrap_addr"],
            kv_params["remote_engine_id"],
            max(wait_s, 1.0),
        )

    def poll(self, pull: VllmPull) -> bool:
        assert self.puller is not None
        return self.puller.poll(pull)

    def land(self, pull: VllmPull, fused, dests: list[int]) -> list[str]:
        """Translate the pull's blocks into `dests` of the paged cache `fused`, give staging back;
        the fused blocks' checksums."""
        assert self.puller is not None
        try:
            fault = faults.take("vllm.pull.perturb")  # test-only; None unless armed
            if fault is not None:  # one staged block perturbed, every layer
                block, delta = fault["block_index"], fault["delta"]
                for layer in self.puller.layers:
                    layer[pull.staging[block]] += delta
            return translate_blocks(self.puller.layers, pull.staging, fused, dests)
        finally:
            self.puller.release(pull)

    def release(self, pull: VllmPull) -> None:
        if self.puller is not None:
            self.puller.release(pull)

    def debug_state_counts(self) -> dict[str, int]:
        if self.puller is None:
            return {"kv.vllm_pulls": 0, "kv.vllm_staging_blocks_held": 0}
        return self.puller.debug_state_counts()

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()
