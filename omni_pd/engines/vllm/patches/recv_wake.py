"""Fix (f): a decode engine wakes when a KV receive ends, rather than stepping to find out.

Upstream (vLLM 0.32.0, `MooncakeConnectorWorker`): a pull's end (its blocks written, or its
failure) is recorded in `finished_recving_reqs` on the connector's receiver thread; the engine
learns of it only when it next steps (`get_finished`). An engine whose every request waits for
its KV must therefore step again and again (omni-pd's did: a 1 ms sleep and a full step per
turn) or add up to its poll interval to every handoff.

Patched: after the connector records a receive's end (`process_pulling_result`,
`_handle_failed_recv`), it also signals every waker registered in this process (an eventfd,
`open_waker`; the worker resets it, `StageEngine.wait_for_io`). omni-pd's vLLM engine registers one and the stage worker's loop waits on it beside
its pipe (`multiprocessing.connection.wait`), so it steps when the KV lands. A wake that is not
for its requests costs one step. Without the patch (or a waker) the engine polls as before.
"""

from __future__ import annotations

import inspect
import os
import threading

from ._guard import Patch, mark_patched

SUPPORTED = ("0.32.0",)
_wakers: set[int] = set()
_wakers_lock = threading.Lock()


def open_waker() -> int:
    """A non-blocking eventfd that becomes readable when any KV receive in this process ends."""
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    with _wakers_lock:
        _wakers.add(fd)
    return fd


def close_waker(fd: int) -> None:
    with _wakers_lock:
        _wakers.discard(fd)
    os.close(fd)


def signal_all() -> None:
    with _wakers_lock:
        for fd in _wakers:
            os.eventfd_write(fd, 1)


def _install() -> str | None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    cls = mc.MooncakeConnectorWorker
    for name in ("process_pulling_result", "_handle_failed_recv"):
        if "self.finished_recving_reqs.add(" not in inspect.getsource(getattr(cls, name)):
            raise RuntimeError(f"MooncakeConnectorWorker.{name} no longer records ended receives")
    for name in ("process_pulling_result", "_handle_failed_recv"):
        original = getattr(cls, name)

        def wrapped(self, *args, _original=original, **kwargs):
            before = len(self.finished_recving_reqs)
            try:
                return _original(self, *args, **kwargs)
            finally:
                if len(self.finished_recving_reqs) != before:
                    signal_all()

        mark_patched(cls, name, wrapped)
    return None


PATCH = Patch(
    name="recv_wake",
    what="MooncakeConnector receives signal an eventfd when they end (the decode engine waits on "
    "it instead of stepping until its KV is in)",
    supported=SUPPORTED,
    install=_install,
)
