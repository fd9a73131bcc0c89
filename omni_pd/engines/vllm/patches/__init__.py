"""omni-pd's fixes to vLLM, one module per upstream shortcoming, each guarded by the vLLM
versions it was written for. `apply_all()` is idempotent and never raises: a patch that does not
fit the installed vLLM is refused, logged once, and reported by `results()`; the omni-pd vLLM
engine refuses to run a P/D stage whose fixes were refused."""

from __future__ import annotations

from ._guard import PatchResult, results, vllm_version
from . import (
    consumer_peer_watch,
    cpu_device_index,
    decode_resume,
    offline_drain,
    prefill_kv_params,
    receiver_socket_reuse,
    recv_wake,
)

ALL_PATCHES = (
    prefill_kv_params.PATCH,
    offline_drain.PATCH,
    cpu_device_index.PATCH,
    consumer_peer_watch.PATCH,
    decode_resume.PATCH,
    recv_wake.PATCH,
    receiver_socket_reuse.PATCH,
)


def apply_all() -> dict[str, PatchResult]:
    for patch in ALL_PATCHES:
        patch.apply()
    return results()


__all__ = ["ALL_PATCHES", "PatchResult", "apply_all", "results", "vllm_version"]
