"""Test-only fault hooks: one registry, inert unless a test arms it.

Production code names a hook point and consults it where the fault would strike: `take(point)`
hands over a one-shot fault's parameters (None when the point is not armed), `armed(point)`
says whether one waits and `peek(point)` reads it in place, `hit(point)` runs a point whose fault acts by itself (the push leg's
stop). Unarmed, each is one lookup in an empty dict. Nothing in production arms a point.

Tests arm them in-process (`arm`, or `arming(...)` as a context manager; `disarm()` clears
every point), or in a stage worker through the generic control call
`arm_fault(fault=..., **params)` (`engines.base.StageEngine.arm_fault`), which arms the named
fault below: one name per fault a test exercises, each arming the points it needs.

The registry is per process: a point armed in a worker strikes whichever engine of that worker
reaches it first (one engine per worker; in-process tests arm just before the call they test).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

# The hook points production code consults, and what an armed one does there.
POINTS: dict[str, str] = {
    "kv.publish.flip": "the next KV publish or push flips one byte of one block (block_index, "
    "byte_offset), before its checksum (unseen) or after (after_checksum: the decode side must catch it)",
    "prefill.uncacheable": "the next request a prefill leg admits stays out of its prefix cache both "
    "ways, so that a flipped byte corrupts that request alone",
    "kv.push.chunk_sent": "the push leg stops its own process (SIGSTOP) once the writes of "
    "`after_chunks` chunks are submitted",
    "vllm.serve.perturb": "the next offer to a vLLM consumer has block block_index perturbed by delta "
    "in staging, after its checked translation",
    "vllm.serve.refuse": "the next offer to a vLLM consumer is held but its consumer's ask refused",
    "vllm.pull.perturb": "block block_index of the next pull from a vLLM producer is perturbed by "
    "delta in staging, before its translation",
    "vllm.pull.miss": "the next pull from a vLLM producer waits 0 s, so it misses its window",
    "chunked.stream.fail": "the next streamed utterance of a chunked decoder fails once it has "
    "`after_chunks` pieces",
}

_armed: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def arm(point: str, **params: Any) -> None:
    """Arm `point` with `params` (replacing any fault armed there)."""
    if point not in POINTS:
        raise ValueError(f"no fault hook point {point!r}; the points are {sorted(POINTS)}")
    with _lock:
        _armed[point] = dict(params)
    log.warning("fault hook %s armed with %s (test hook)", point, params)


def disarm(point: str | None = None) -> None:
    """Disarm `point`, or every point."""
    with _lock:
        if point is None:
            _armed.clear()
        else:
            _armed.pop(point, None)


def armed(point: str) -> bool:
    """Whether a fault waits at `point` (it stays armed)."""
    return point in _armed


def peek(point: str) -> dict[str, Any] | None:
    """The parameters of the fault armed at `point`, which stays armed; None if none."""
    return _armed.get(point)


def take(point: str) -> dict[str, Any] | None:
    """The parameters of the fault armed at `point`, which is then disarmed; None if none."""
    if not _armed:
        return None
    with _lock:
        return _armed.pop(point, None)


def hit(point: str, **context: Any) -> None:
    """A point whose armed fault acts by itself, after `after_chunks` hits (then it is
    disarmed); nothing unless armed."""
    if point not in _armed:
        return
    with _lock:
        params = _armed.get(point)
        if params is None:
            return
        params["after_chunks"] -= 1
        if params["after_chunks"] > 0:
            return
        del _armed[point]
    _ACTIONS[point](context)


@contextmanager
def arming(point: str, **params: Any) -> Iterator[None]:
    """Arm `point` for the block, disarming it after (fired or not)."""
    arm(point, **params)
    try:
        yield
    finally:
        disarm(point)


# ---- points that act by themselves ----------------------------------------------------------


def _stop_this_process(context: dict[str, Any]) -> None:
    """Stop this process (a test then kills either peer at a known point mid-push, and lets
    this one go on with SIGCONT)."""
    log.warning(
        "transfer %s: this worker stops itself mid-push (kv.push.chunk_sent fault hook)",
        context.get("transfer_id"),
    )
    os.kill(os.getpid(), signal.SIGSTOP)


_ACTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "kv.push.chunk_sent": _stop_this_process,
}


# ---- the named faults a stage worker arms (StageEngine.arm_fault) -------------------------------


def _kv_corruption(block_index: int = 0, byte_offset: int = 3, after_checksum: bool = False) -> None:
    """The next published (or pushed) request gets one flipped byte; its blocks stay out of the
    prefix cache both ways, so the flip corrupts that request alone, as a fault in transit
    would, and not the cached prefix of the requests after it."""
    if block_index < 0 or byte_offset < 0:
        raise ValueError("kv_corruption: block_index and byte_offset must be >= 0")
    arm("kv.publish.flip", block_index=block_index, byte_offset=byte_offset, after_checksum=after_checksum)
    arm("prefill.uncacheable")


def _push_stop(after_chunks: int = 1) -> None:
    if after_chunks < 1:
        raise ValueError(f"push_stop: after_chunks must be at least 1, got {after_chunks}")
    arm("kv.push.chunk_sent", after_chunks=after_chunks)


def _vllm_serve_corruption(block_index: int = 0, delta: float = 0.5) -> None:
    arm("vllm.serve.perturb", block_index=block_index, delta=delta)


def _vllm_serve_refusal() -> None:
    arm("vllm.serve.refuse")


def _vllm_pull_corruption(block_index: int = 0, delta: float = 0.5) -> None:
    arm("vllm.pull.perturb", block_index=block_index, delta=delta)


def _vllm_pull_miss() -> None:
    arm("vllm.pull.miss")


def _chunk_failure(after_chunks: int) -> None:
    arm("chunked.stream.fail", after_chunks=int(after_chunks))


FAULTS: dict[str, Callable[..., None]] = {
    "kv_corruption": _kv_corruption,
    "push_stop": _push_stop,
    "vllm_serve_corruption": _vllm_serve_corruption,
    "vllm_serve_refusal": _vllm_serve_refusal,
    "vllm_pull_corruption": _vllm_pull_corruption,
    "vllm_pull_miss": _vllm_pull_miss,
    "chunk_failure": _chunk_failure,
}


def arm_fault(fault: str, **params: Any) -> None:
    """Arm the named fault (FAULTS) in this process."""
    if fault not in FAULTS:
        raise ValueError(f"no fault {fault!r}; the faults are {sorted(FAULTS)}")
    FAULTS[fault](**params)
