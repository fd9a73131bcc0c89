"""Errors raised by the KV data plane. Each message says what happened and what to change."""

from __future__ import annotations


class KVError(RuntimeError):
    """Base class for KV data-plane failures."""


class PoolExhausted(KVError):
    """A BlockPool has fewer free blocks than a request needs."""


class KVTransferError(KVError):
    """Mooncake reported a failed transfer (dead, unreachable or frozen peer, unregistered memory)."""


class KVIntegrityError(KVError):
    """Transferred bytes do not match the checksums the sender published."""


class KVMissError(KVTransferError):
    """The prefill side's KV did not arrive within the miss window (frozen, overloaded or
    unreachable peer); the decode side stopped waiting."""


class KVIncompatibleError(KVTransferError):
    """The prefill and decode engines' KV fingerprints differ (model, weights, dtype, geometry):
    KV from that peer would be read wrongly, so no handoff is attempted."""
