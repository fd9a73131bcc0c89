"""Fix (d): a decode engine's KV receive from a prefill engine that has died ends when it dies.

Upstream (vLLM 0.32.0, `MooncakeConnectorWorker.receive_kv_from_single_worker`): the decode
worker sends its block addresses to the prefill worker over ZMQ and waits for the answer with
`RCVTIMEO` = `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` + 60 s (540 s by default). ZMQ does not tell a
waiting socket that its peer is gone, so when the prefill process dies the receive waits all of
that, and the scheduler keeps the request's blocks (an aborted request's too: vLLM frees them only
once the receive settles, since the prefill side writes into them). A decode engine that aborted
such a request holds its blocks, and its scheduler the request, for nine minutes.

Patched: while a receive is pending, every `PROBE_INTERVAL_S` the decode side asks the prefill
engine's bootstrap server (`<remote_bootstrap_addr>/query`, the address the receive came with).
When that server refuses connections, or answers for other engines only (a restarted prefill
worker on a pinned port), the prefill engine is gone and can write nothing more: the receive is
cancelled and reported failed through the connector's own `_handle_failed_recv` (the scheduler
frees the blocks of an aborted request, and fails a waiting one by its `kv_load_failure_policy`).
A server that does not answer in time (a frozen or busy process) is not taken for dead: it may
still write, so the receive keeps waiting, as upstream. Receives that finish within the first
interval (every healthy one) never probe.
"""

from __future__ import annotations

import asyncio
import contextlib

from ._guard import Patch, log, mark_patched

SUPPORTED = ("0.32.0",)
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0


async def producer_gone(
    bootstrap_addr: str, engine_id: str, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """Why the prefill engine `engine_id` behind `bootstrap_addr` is certainly gone, or None while
    it answers or cannot be told apart from a slow (or frozen) one."""
    import httpx

    url = bootstrap_addr.rstrip("/") + "/query"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
    except httpx.ConnectError as exc:  # nothing listens: the process that did has exited
        return f"its bootstrap server {url} refuses connections ({exc})"
    except httpx.HTTPError:  # a timeout or a broken answer: maybe frozen, maybe busy
        return None
    if response.status_code != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    ids = sorted(str(entry.get("engine_id")) for entry in data.values() if isinstance(entry, dict))
    if engine_id not in ids:
        return f"its bootstrap server {url} now serves engine(s) {ids}, not {engine_id}"
    return None


def _install() -> str | None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    worker = mc.MooncakeConnectorWorker
    fields = getattr(mc.PullReqMeta, "__dataclass_fields__", {})
    needed = ("remote_bootstrap_addr", "remote_engine_id", "pull_tasks_count", "failed")
    missing = [name for name in needed if name not in fields]
    if missing or not hasattr(worker, "_handle_failed_recv"):
        raise RuntimeError(
            f"PullReqMeta lacks {missing}"
            if missing
            else "MooncakeConnectorWorker has no _handle_failed_recv"
        )
    original = worker.receive_kv_from_single_worker

    async def receive_kv_from_single_worker(self, worker_addr, pull_metas):
        task = asyncio.ensure_future(original(self, worker_addr, pull_metas))
        first = next(iter(pull_metas.values()), None)
        try:
            while first is not None:
                done, _ = await asyncio.wait({task}, timeout=PROBE_INTERVAL_S)
                if done:
                    break
                gone = await producer_gone(first.remote_bootstrap_addr, first.remote_engine_id)
                if gone is None or task.done():
                    continue
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                waiting = [r for r, m in pull_metas.items() if not m.failed and m.pull_tasks_count > 0]
                log.info(
                    "omni-pd: KV receive of %s from prefill engine %s ended: %s",
                    waiting,
                    first.remote_engine_id,
                    gone,
                )
                self._handle_failed_recv(
                    pull_metas, waiting, f"prefill engine {first.remote_engine_id} is gone: {gone}"
                )
                return None
            return await task
        finally:
            if not task.done():  # this wrapper was cancelled (shutdown): so is the receive
                task.cancel()

    mark_patched(worker, "receive_kv_from_single_worker", receive_kv_from_single_worker)
    return None


PATCH = Patch(
    name="consumer_peer_watch",
    what="a decode engine's KV receive ends when its prefill engine has exited",
    supported=SUPPORTED,
    install=_install,
)
