"""`KVDescriptor`: what the decode side needs to pull one request's prompt KV, and its
kv_transfer_params form (checked key by key when read)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..checksum import CHECKSUM_KINDS
from ..layout import BlockLayout


def _need(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...], tid: str) -> Any:
    if key not in params:
        raise ValueError(f"kv_transfer_params for transfer {tid} is missing {key!r}")
    value = params[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(
            f"kv_transfer_params[{key!r}] for transfer {tid}: expected {names}, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    return value


@dataclass(frozen=True)
class KVDescriptor:
    """Everything the decode side needs to pull one request's prompt KV."""

    transfer_id: str
    remote_engine_id: str
    remote_session: str
    remote_block_ids: tuple[int, ...]
    remote_base_address: int
    block_bytes: int
    num_tokens: int
    kv_layout: BlockLayout
    block_checksums: tuple[str, ...]
    # The same-host paths: where the prefill's shared pool can be mapped (host memory), or its
    # CUDA IPC handle (a GPU pool), and on which host.
    shm_path: str | None = None
    host_id: str | None = None
    cuda_ipc: str | None = None
    checksum_kind: str = "xxh3"  # how block_checksums were taken (checksum.py)

    KEYS = (
        "transfer_id",
        "remote_engine_id",
        "remote_session",
        "remote_block_ids",
        "remote_base_address",
        "block_bytes",
        "num_tokens",
        "kv_layout",
        "block_checksums",
    )
    OPTIONAL_KEYS = ("shm_path", "host_id", "cuda_ipc", "checksum_kind")

    def __post_init__(self) -> None:
        tid = self.transfer_id
        if self.num_tokens < 1 or self.remote_base_address <= 0 or self.block_bytes < 1:
            raise ValueError(
                f"transfer {tid}: num_tokens, remote_base_address and block_bytes "
                f"must be positive ({self.num_tokens}, {self.remote_base_address}, "
                f"{self.block_bytes})"
            )
        if self.block_bytes != self.kv_layout.block_bytes:
            raise ValueError(
                f"kv_transfer_params['block_bytes'] for transfer {tid}: {self.block_bytes} "
                f"disagrees with kv_layout ({self.kv_layout.block_bytes})"
            )
        expected = self.kv_layout.num_blocks_for(self.num_tokens)
        if len(self.remote_block_ids) != expected or len(self.block_checksums) != expected:
            raise ValueError(
                f"transfer {tid}: {self.num_tokens} tokens need {expected} blocks, got "
                f"{len(self.remote_block_ids)} remote_block_ids and "
                f"{len(self.block_checksums)} block_checksums"
            )
        if any(b < 0 for b in self.remote_block_ids):
            raise ValueError(f"kv_transfer_params['remote_block_ids'] for transfer {tid}: negative id")
        if self.checksum_kind not in CHECKSUM_KINDS:
            raise ValueError(
                f"kv_transfer_params['checksum_kind'] for transfer {tid}: expected one "
                f"of {list(CHECKSUM_KINDS)}, got {self.checksum_kind!r}"
            )

    def without_first(self, blocks: int) -> "KVDescriptor":
        """The same transfer less its first `blocks` blocks (the decode side holds them already:
        its prefix cache), so only the rest moves. Positions stay block-aligned."""
        if not 0 < blocks < len(self.remote_block_ids):
            raise ValueError(
                f"transfer {self.transfer_id}: cannot skip {blocks} of its "
                f"{len(self.remote_block_ids)} blocks"
            )
        return dataclasses.replace(
            self,
            remote_block_ids=self.remote_block_ids[blocks:],
            block_checksums=self.block_checksums[blocks:],
            num_tokens=self.num_tokens - blocks * self.kv_layout.block_size,
        )

    def remote_address(self, index: int) -> int:
        return self.remote_base_address + self.remote_block_ids[index] * self.block_bytes

    def to_params(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "remote_engine_id": self.remote_engine_id,
            "remote_session": self.remote_session,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_base_address": self.remote_base_address,
            "block_bytes": self.block_bytes,
            "num_tokens": self.num_tokens,
            "kv_layout": self.kv_layout.to_dict(),
            "block_checksums": list(self.block_checksums),
            **{key: getattr(self, key) for key in ("shm_path", "host_id", "cuda_ipc") if getattr(self, key)},
            **({"checksum_kind": self.checksum_kind} if self.checksum_kind != "xxh3" else {}),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "KVDescriptor":
        """Read our keys out of kv_transfer_params; other (vLLM) keys are left alone."""
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params: expected a dict, got {type(params).__name__}")
        tid = _need(params, "transfer_id", str, "<unknown>")
        ids = _need(params, "remote_block_ids", (list, tuple), tid)
        sums = _need(params, "block_checksums", (list, tuple), tid)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            raise ValueError(
                f"kv_transfer_params['remote_block_ids'] for transfer {tid}: expected a list of ints"
            )
        if not all(isinstance(s, str) for s in sums):
            raise ValueError(
                f"kv_transfer_params['block_checksums'] for transfer {tid}: expected a list of hex strings"
            )
        layout_dict = _need(params, "kv_layout", dict, tid)
        try:
            layout = BlockLayout.from_dict(layout_dict)
        except ValueError as exc:
            raise ValueError(f"kv_transfer_params['kv_layout'] for transfer {tid}: {exc}") from exc
        return cls(
            transfer_id=tid,
            remote_engine_id=_need(params, "remote_engine_id", str, tid),
            remote_session=_need(params, "remote_session", str, tid),
            remote_block_ids=tuple(ids),
            remote_base_address=_need(params, "remote_base_address", int, tid),
            block_bytes=_need(params, "block_bytes", int, tid),
            num_tokens=_need(params, "num_tokens", int, tid),
            kv_layout=layout,
            block_checksums=tuple(sums),
            **{key: _need(params, key, str, tid) for key in cls.OPTIONAL_KEYS if key in params},
        )
