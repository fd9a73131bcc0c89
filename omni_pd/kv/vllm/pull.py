"""The consumer half of vLLM 0.32's MooncakeConnector, for a decode engine that is not vLLM.

An unmodified vLLM prefill engine with `kv_role: kv_producer` keeps a finished prompt's blocks
for its decode side and answers on a ZMQ side channel that its bootstrap server names
(`GET <remote_bootstrap_addr>/query` -> `{dp_rank: {engine_id, worker_addr: {tp: {pp: addr}}}}`).
The decode side sends one msgpack `MooncakeXferMetadata` (its Mooncake session, the request's
destination block ids per KV group, and per registered layer region its base address, block
length and vLLM layer name) and the producer writes the blocks into that memory with Mooncake
(`batch_transfer_sync_write`), then answers `MooncakeXferResponse` (FINISH with ok_reqs /
err_reqs, or ERROR with a message). A consumer that asks for fewer blocks than the producer holds
gets the *last* ones (vLLM's partial prefix hit): the prefix it holds already never moves.

`VllmKVPuller` is that consumer: its staging memory mirrors the producer's regions (one per layer,
vLLM's CPU block layout, `layout.py`), registered once with this engine's Mooncake
transport. Each pull runs its blocking ZMQ exchange on a worker thread, bounded by the request's
wait; a pull given up on keeps its staging blocks until the producer's answer (or the socket's
timeout) ends the exchange, so a late write never lands in reused memory.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field


from ..errors import KVMissError, KVTransferError
from ..transport import KVTransport
from .layout import VllmKVGeometry
from .staging import VllmStaging

log = logging.getLogger(__name__)

_FINISH, _CONTINUE, _ERROR = 0, 1, 2  # MooncakeXferResponseStatus
# After the wait runs out, how long an abandoned exchange may still hold its staging blocks for
# the producer's answer (vLLM answers within VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).
ABANDONED_ANSWER_S = 600.0
_POLL_SLICE_MS = 100  # how often a waiting exchange looks whether the puller is closing


@dataclass
class VllmPull:
    """One request's blocks on their way from a vLLM producer."""

    transfer_id: str
    staging: list[int]  # staging block ids, in the prompt's order
    result: Future = field(repr=False)
    abandoned: bool = False  # released while its exchange still ran: quarantined
    ended: bool = False  # the exchange with the producer is over: nothing more can land


class VllmKVPuller:
    def __init__(self, transport: KVTransport, geometry: VllmKVGeometry, staging_blocks: int):
        import msgspec  # vLLM's own dependencies: present wherever a vLLM producer is
        import zmq

        self._msgpack, self._zmq = msgspec.msgpack, zmq
        self.transport, self.geometry, self.num_staging = transport, geometry, staging_blocks
        self.staging = VllmStaging(transport, geometry, staging_blocks)
        self.layers = self.staging.layers
        self._lock = threading.Lock()
        self._pulls: dict[str, VllmPull] = {}
        self._workers: dict[str, str] = {}  # bootstrap address -> the producer worker's ZMQ address
        self._context = zmq.Context()
        self.thread_prefix = f"vllm-kv-pull-{transport.session_id}"
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix=self.thread_prefix)
        self._closing = threading.Event()
        host, port = transport.session_id.rsplit(":", 1)
        self._host, self._port = host, int(port)

    # ---- the producer's address ---------------------------------------------------------------
    def worker_address(self, bootstrap_addr: str, engine_id: str, timeout_s: float) -> str:
        """The ZMQ address of the producer's (tp 0, pp 0) worker, from its bootstrap server."""
        if bootstrap_addr in self._workers:
            return self._workers[bootstrap_addr]
        import httpx

        try:
            answer = httpx.get(f"{bootstrap_addr}/query", timeout=timeout_s).raise_for_status().json()
        except Exception as exc:  # noqa: BLE001 - reported with the address
            raise KVTransferError(
                f"the vLLM producer's bootstrap server {bootstrap_addr} did not answer /query "
                f"({type(exc).__name__}: {exc}); is its prefill engine up?"
            ) from exc
        entries = [entry for entry in answer.values() if entry.get("engine_id") == engine_id]
        if len(entries) != 1:
            raise KVTransferError(
                f"the bootstrap server {bootstrap_addr} knows engines "
                f"{sorted(e.get('engine_id') for e in answer.values())}, not {engine_id!r} once"
            )
        ranks = entries[0]["worker_addr"]
        if set(ranks) != {"0"} or set(ranks["0"]) != {"0"}:
            raise KVIncompatibleTopology(
                f"vLLM engine {engine_id} runs tensor/pipeline ranks {ranks}: this consumer reads "
                "one worker (tensor_parallel_size 1, pipeline_parallel_size 1)"
            )
        self._workers[bootstrap_addr] = ranks["0"]["0"]
        return self._workers[bootstrap_addr]

    # ---- pulls --------------------------------------------------------------------------------
    def start(self, transfer_id: str, worker_addr: str, num_blocks: int, wait_s: float) -> VllmPull:
        """Ask the producer for the last `num_blocks` blocks of transfer `transfer_id`."""
        pull = self._reserve(transfer_id, num_blocks)
        metadata = self._metadata(f"omni-pd-{uuid.uuid4().hex[:12]}", transfer_id, pull.staging)
        self._threads.submit(self._exchange, pull, worker_addr, metadata, wait_s)
        return pull

    def start_at(
        self,
        transfer_id: str,
        bootstrap_addr: str,
        engine_id: str,
        num_blocks: int,
        wait_s: float,
        query_s: float | None = None,
    ) -> VllmPull:
        """`start`, the producer named by its bootstrap server. A producer's first pull asks the
        server for its worker's address on the pull's thread (within `query_s`, default the
        wait; the exchange then gets what is left of the wait), so that the caller (an engine
        step) never waits on it; a failed query is the pull's error."""
        pull = self._reserve(transfer_id, num_blocks)
        metadata = self._metadata(f"omni-pd-{uuid.uuid4().hex[:12]}", transfer_id, pull.staging)
        query_s = max(wait_s if query_s is None else query_s, 0.1)
        self._threads.submit(self._exchange_at, pull, bootstrap_addr, engine_id, metadata, wait_s, query_s)
        return pull

    def release_at(self, transfer_id: str, bootstrap_addr: str, engine_id: str, timeout_s: float) -> None:
        """Tell the producer that this consumer needs none of transfer `transfer_id`'s blocks (its
        prefix cache holds the whole prompt), so that it frees them now rather than at its
        abort timeout: vLLM's own consumer sends the same empty request. On the pool's thread;
        nothing is held (the exchange has no record in `_pulls`), and a producer that does not
        answer within `timeout_s` is only logged."""
        pull = VllmPull(transfer_id, [], Future(), abandoned=True)

        def logged(done: Future) -> None:
            if done.exception() is not None:
                log.debug("transfer %s: releasing the producer's blocks: %s", transfer_id, done.exception())

        pull.result.add_done_callback(logged)
        metadata = self._metadata(f"omni-pd-{uuid.uuid4().hex[:12]}", transfer_id, [])
        timeout_s = max(timeout_s, 0.1)
        self._threads.submit(
            self._exchange_at, pull, bootstrap_addr, engine_id, metadata, timeout_s, timeout_s
        )

    def _exchange_at(
        self,
        pull: VllmPull,
        bootstrap_addr: str,
        engine_id: str,
        metadata: bytes,
        wait_s: float,
        query_s: float,
    ) -> None:
        began = time.monotonic()
        try:
            worker_addr = self.worker_address(bootstrap_addr, engine_id, query_s)
        except Exception as exc:  # noqa: BLE001 - the pull's error: nothing was asked of anyone
            with self._lock:
                pull.ended = True
                self._forget(pull)
            pull.result.set_exception(exc)
            return
        self._exchange(pull, worker_addr, metadata, max(wait_s - (time.monotonic() - began), 0.0))

    def _reserve(self, transfer_id: str, num_blocks: int) -> VllmPull:
        """The pull's record and its staging blocks."""
        with self._lock:
            if transfer_id in self._pulls:
                raise ValueError(f"transfer {transfer_id} is already being pulled")
            staging = self.staging.take(num_blocks, "raise the decode stage's kv_pool_blocks")
            pull = VllmPull(transfer_id, staging, Future())
            self._pulls[transfer_id] = pull
        return pull

    def poll(self, pull: VllmPull) -> bool:
        """True once the blocks are in staging; raises what the producer or the wait reported."""
        if not pull.result.done():
            return False
        pull.result.result()  # raises the pull's error
        return True

    def wait(self, pull: VllmPull, timeout_s: float) -> None:
        pull.result.result(timeout=timeout_s)

    def release(self, pull: VllmPull) -> None:
        """Give the staging blocks back (done with them), or quarantine them until the exchange
        ends (a pull given up on)."""
        with self._lock:
            if pull.ended:
                self._forget(pull)
            else:
                pull.abandoned = True

    def _forget(self, pull: VllmPull) -> None:
        if self._pulls.get(pull.transfer_id) is pull:
            del self._pulls[pull.transfer_id]
            self.staging.give(pull.staging)

    def _metadata(self, request_key: str, transfer_id: str, staging: list[int]) -> bytes:
        geometry, count = self.geometry, self.geometry.num_layers
        return self._msgpack.encode(
            {
                "remote_hostname": self._host,
                "remote_port": self._port,
                "remote_tp_size": 1,
                "remote_tp_rank": 0,
                "req_blocks": {request_key: [transfer_id, [staging]]},
                "kv_caches_base_addr": [self.staging.address(i, 0) for i in range(count)],
                "block_lens": [geometry.block_bytes] * count,
                "kv_block_lens": [geometry.block_bytes] * count,
                "registered_layer_names": list(geometry.layer_names),
                "registered_layer_indices": list(geometry.layer_indices),
                "registered_group_indices": [0] * count,
                "registered_shared_group_ids": [[0]] * count,
                "registered_row_offsets": [-1] * count,
                "remote_pp_size": 1,
            }
        )

    def _exchange(self, pull: VllmPull, worker_addr: str, metadata: bytes, wait_s: float) -> None:
        zmq = self._zmq
        error: Exception | None = None
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(worker_addr)
            socket.send(metadata)
            timeout_ms, missed = int(wait_s * 1000), False
            while True:
                if not self._poll(socket, timeout_ms):
                    if missed:
                        break  # no answer at all: the producer is gone
                    # Tell the engine now, and keep listening: the producer may still write.
                    missed, timeout_ms = True, int(ABANDONED_ANSWER_S * 1000)
                    pull.result.set_exception(
                        KVMissError(
                            f"transfer {pull.transfer_id}: the vLLM producer at {worker_addr} "
                            f"sent no KV within {wait_s:.3g} s (kv_miss_window_s)"
                        )
                    )
                    continue
                answer = self._msgpack.decode(socket.recv())
                status = answer.get("status")
                if status == _ERROR or answer.get("err_reqs"):
                    error = KVTransferError(
                        f"transfer {pull.transfer_id}: the vLLM producer refused or failed it: "
                        f"{answer.get('err_msg') or 'no message'}"
                    )
                    break
                if status == _FINISH:
                    if not answer.get("ok_reqs"):
                        error = KVTransferError(
                            f"transfer {pull.transfer_id}: the vLLM producer finished without sending it"
                        )
                    break
        except Exception as exc:  # noqa: BLE001 - handed to the poller
            error = KVTransferError(f"transfer {pull.transfer_id}: {type(exc).__name__}: {exc}")
        finally:
            socket.close(0)
        with self._lock:  # ended before the result: a releaser that saw the result frees at once
            pull.ended = True
            if pull.abandoned:
                self._forget(pull)
        if not pull.result.done():  # not yet told (a miss was)
            if error is None:
                pull.result.set_result(None)
            else:
                pull.result.set_exception(error)

    # ---- state --------------------------------------------------------------------------------
    def debug_state_counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "kv.vllm_pulls": len(self._pulls),
                "kv.vllm_staging_blocks_held": self.staging.held,
            }

    def _poll(self, socket, timeout_ms: int) -> bool:
        """socket.poll in slices, so that close() ends a wait (an abandoned pull listens for its
        answer for ABANDONED_ANSWER_S) at once instead of leaving a thread that the
        interpreter's exit would join."""
        end = time.monotonic() + timeout_ms / 1000
        while not self._closing.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            if socket.poll(min(_POLL_SLICE_MS, max(1, int(left * 1000)))):
                return True
        raise KVTransferError("the vLLM KV puller was closed while waiting for the producer")

    def close(self) -> None:
        self._closing.set()  # every exchange's wait ends within _POLL_SLICE_MS
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._context.destroy(linger=0)
        self.staging.close()


class KVIncompatibleTopology(KVTransferError):
    """The vLLM producer runs a parallel layout this consumer does not read."""
