"""What a P/D leg reads of its stage's `kv_transfer_config`, with omni-pd's defaults."""

from __future__ import annotations

from dataclasses import dataclass

from ...config.schema import KVConnectorExtraConfig


@dataclass(frozen=True)
class TransferSettings:
    host: str  # kv_ip: the address Mooncake registers (default loopback)
    protocol: str  # mooncake_protocol (default tcp)
    engine_id: str | None  # the file's engine_id, else one is made up at start
    # vLLM's kv_buffer_device: where Mooncake moves a GPU stage's KV from ("cuda": the GPU
    # memory itself; "cpu": a pinned host copy; unset: the GPU where Mooncake can).
    buffer_device: str | None
    handoff: KVConnectorExtraConfig  # omni-pd's handoff keys (windows, breaker, same host, ...)

    @classmethod
    def of(cls, stage_config) -> "TransferSettings":
        kv = stage_config.kv_transfer_config
        extra = kv.kv_connector_extra_config if kv else KVConnectorExtraConfig()  # the defaults
        return cls(
            host=(kv.kv_ip if kv and kv.kv_ip else "127.0.0.1"),
            protocol=extra.mooncake_protocol or "tcp",
            engine_id=kv.engine_id if kv and kv.engine_id else None,
            buffer_device=kv.kv_buffer_device if kv else None,
            handoff=extra,
        )
