"""Host memory in vLLM's CPU KV layout that Mooncake reads from or writes into, for both
cross-engine directions: the hf decode side's staging for a vLLM producer's blocks
(kv/vllm/pull.py) and the hf prefill side's translated copy for vLLM consumers
(kv/vllm/serve.py). One region per vLLM layer, `num_blocks` blocks each (the per-layer views
are `layers`), registered once with the transport, and the free list of its block slots. The
owner locks around take / give.
"""

from __future__ import annotations

import logging

import torch

from ..errors import PoolExhausted
from ..transport import KVTransport
from .layout import VllmKVGeometry, layer_views

log = logging.getLogger(__name__)


class VllmStaging:
    def __init__(self, transport: KVTransport, geometry: VllmKVGeometry, num_blocks: int):
        self.transport, self.geometry, self.num_blocks = transport, geometry, num_blocks
        self.region_bytes = num_blocks * geometry.block_bytes
        self.buffer = torch.zeros(self.region_bytes * geometry.num_layers, dtype=torch.uint8)
        self.layers = layer_views(self.buffer, geometry, num_blocks)
        transport.register(self.buffer.data_ptr(), self.buffer.numel())
        self._free = list(range(num_blocks))

    def take(self, count: int, hint: str) -> list[int]:
        """`count` free block slots; PoolExhausted (ending with `hint`: what to change) if fewer."""
        if count > len(self._free):
            raise PoolExhausted(
                f"{count} vLLM staging blocks needed, {len(self._free)} of {self.num_blocks} free; {hint}"
            )
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def reset(self) -> None:
        self._free = list(range(self.num_blocks))

    @property
    def held(self) -> int:
        return self.num_blocks - len(self._free)

    def address(self, layer: int, block: int) -> int:
        """Where block slot `block` of layer `layer` lies (for the peer's Mooncake entries)."""
        return self.buffer.data_ptr() + layer * self.region_bytes + block * self.geometry.block_bytes

    def close(self) -> None:
        try:
            self.transport.unregister(self.buffer.data_ptr())
        except Exception:  # noqa: BLE001 - closing
            log.debug("unregistering the vLLM staging buffer failed", exc_info=True)
