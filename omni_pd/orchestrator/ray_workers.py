"""Stage workers as Ray actors (`distributed_executor_backend: ray`), on whichever node of the
cluster offers what the stage asks for.

The actor is only a host for the usual worker loop (`worker.worker_main`): it connects back to
the orchestrator over TCP (`multiprocessing.connection`, the same framed bytes as a local pipe,
authenticated by a per-worker HMAC key) and serves the same message protocol. So the stage
client, its reader thread, heartbeats, restarts and request routing do not change; only how the
worker starts, dies and is reaped does (`RayProcess`).

Placement: an actor takes `runtime.ray_resources` (custom resources such as a node label, and
`CPU` / `GPU` counts) and one GPU per entry of `runtime.devices`; it reserves no CPU unless asked,
since omni-pd sizes each worker's torch threads itself. A stage's KV endpoint binds the actor's
node address (unless `kv_ip` is set), so a decode replica on another node pulls over Mooncake.

The cluster: the one at `RAY_ADDRESS`, or a local one started for this process (and stopped
when the last pipeline that used it closes). An address where no cluster answers fails at once,
naming it, instead of Ray's minutes of retries.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 5.0  # a cluster address that does not accept a TCP connection within this
_lock = threading.Lock()
_users = 0  # pipelines using the Ray connection this module opened
_started_local = False


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached."""


def _probe(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(
            f"RAY_ADDRESS is {address!r}; set it to the head node's host:port "
            "(e.g. 10.0.0.1:6379), to 'auto', or unset it for a local cluster"
        )
    try:
        socket.create_connection((host, int(port)), PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise RayUnavailable(
            f"no Ray cluster answers at RAY_ADDRESS={address} ({exc}); start one "
            "there (`ray start --head`), fix RAY_ADDRESS, or unset it to run a "
            "local cluster"
        ) from None


def acquire_cluster() -> None:
    """Connect this process to Ray (once; counted, see `release_cluster`)."""
    global _users, _started_local
    with _lock:
        try:
            import ray
        except ImportError:
            raise RayUnavailable(
                "distributed_executor_backend: ray needs Ray: install omni-pd's "
                "[ray] extra (scripts/setup.sh with OMNI_PD_RAY=1)"
            ) from None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "").strip()
            if address and address != "auto":
                _probe(address.removeprefix("ray://"))
            try:
                # "local": a cluster of this process's own, never one that happens to run here
                ray.init(
                    address=address or "local",
                    log_to_driver=True,
                    logging_level=logging.WARNING,
                    include_dashboard=False,
                )
            except ConnectionError as exc:
                raise RayUnavailable(
                    f"cannot join the Ray cluster (RAY_ADDRESS={address!r}): {exc}"
                ) from None
            _started_local = not address
            log.info(
                "Ray: %s (%d nodes)",
                f"joined the cluster at {address}" if address else "started a local cluster for this process",
                len(ray.nodes()),
            )
        _users += 1


def release_cluster() -> None:
    global _users, _started_local
    with _lock:
        _users = max(_users - 1, 0)
        if _users == 0 and _started_local:
            import ray

            ray.shutdown()
            _started_local = False


def actor_options(stage_config: Any) -> dict[str, Any]:
    runtime = stage_config.runtime
    wanted = dict(runtime.ray_resources)
    gpus = len([d for d in (runtime.devices or "").split(",") if d.strip()])
    return {
        "num_cpus": wanted.pop("CPU", 0),
        "num_gpus": wanted.pop("GPU", gpus),
        "resources": wanted,
        "max_restarts": 0,
    }


def _on_this_node(stage_config: Any) -> Any:
    """The config with its KV endpoint on this node's address (unless the file pins kv_ip),
    and its GPUs as this actor sees them: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it gave
    the actor, so they are 0..n-1 here, whatever the file named."""
    import ray

    if stage_config.runtime.devices and ray.get_gpu_ids():
        visible = ",".join(str(i) for i in range(len(ray.get_gpu_ids())))
        stage_config = stage_config.model_copy(
            update={"runtime": stage_config.runtime.model_copy(update={"devices": visible})}
        )
    kv = stage_config.engine_args.kv_transfer_config
    if kv is None or kv.kv_ip:
        return stage_config
    args = stage_config.engine_args.model_copy(
        update={"kv_transfer_config": kv.model_copy(update={"kv_ip": ray.util.get_node_ip_address()})}
    )
    return stage_config.model_copy(update={"engine_args": args})


class StageActor:
    """The Ray actor class (wrapped by `ray.remote` when first used)."""

    def node(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(
        self,
        stage_config: Any,
        model: str,
        address: tuple[str, int],
        authkey: bytes,
        log_level: int,
        threads: tuple[int, int],
        tag: str,
    ) -> None:
        from .worker import worker_main

        conn = Client(address, authkey=authkey)
        # It returns when the worker stops; the orchestrator then kills the idle actor.
        worker_main(
            _on_this_node(stage_config),
            model,
            conn,
            log_level,
            threads,
            tag,
            watch_parent=False,
            exit_process=False,
        )


_remote_class = None


def _actor_class():
    global _remote_class
    if _remote_class is None:
        import ray

        _remote_class = ray.remote(StageActor)
    return _remote_class


class RayProcess:
    """A stage worker in a Ray actor, with the part of `multiprocessing.Process`'s interface the
    stage client uses (pid, is_alive, join, kill, exitcode). Alive means the worker loop runs;
    the actor outlives it until `kill`, which the stage client always calls when done with it."""

    def __init__(
        self,
        stage_config: Any,
        model: str,
        log_level: int,
        threads: tuple[int, int],
        tag: str,
        startup_timeout_s: float,
    ):
        import ray

        self.tag = tag
        self.pid: int | None = None
        self.node_id = self.node_ip = ""
        options = actor_options(stage_config)
        self.actor = _actor_class().options(name=None, **options).remote()
        try:
            self.node_id, self.node_ip, self.pid = ray.get(
                self.actor.node.remote(), timeout=startup_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise RayUnavailable(
                f"{tag}: no Ray node took the worker within {startup_timeout_s:.0f} s; it asks for "
                f"{options} (runtime.ray_resources, runtime.devices): add a node that offers them, "
                "or ask for less"
            ) from None
        authkey = secrets.token_bytes(32)
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        self.ref = self.actor.run.remote(
            stage_config, model, self._listener.address, authkey, log_level, threads, tag
        )
        self._conn: Connection | None = None  # set once the worker has connected back
        self._accepted = threading.Event()
        threading.Thread(target=self._accept, name=f"omni-pd-{tag}-accept", daemon=True).start()
        log.info("%s: Ray actor on node %s (%s), pid %d", tag, self.node_id[:12], self.node_ip, self.pid)

    def _accept(self) -> None:
        try:
            self._conn = self._listener.accept()
        except OSError:  # closed: the worker never connected
            pass
        finally:
            self._accepted.set()

    def connection(self, timeout_s: float):
        """The worker's connection once it has connected back; None while it has not."""
        if self._accepted.wait(timeout_s):
            self._listener.close()
        return self._conn

    def is_alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else 0

    def describe_exit(self) -> str:
        import ray

        try:
            ray.get(self.ref, timeout=0)
            return f"its Ray actor (pid {self.pid} on {self.node_ip}) exited"
        except ray.exceptions.GetTimeoutError:
            return f"its Ray actor (pid {self.pid} on {self.node_ip}) is still running"
        except ray.exceptions.RayActorError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"its Ray actor (pid {self.pid} on {self.node_ip}) died: {first}"
        except ray.exceptions.RayError as exc:
            return f"its Ray actor (pid {self.pid} on {self.node_ip}) failed: {type(exc).__name__}"

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._listener.close()

    terminate = kill


def wait_connected(process: RayProcess, deadline: float, poll_s: float):
    """The worker's connection, polled until `deadline` (monotonic) or until the actor dies."""
    while True:
        conn = process.connection(poll_s)
        if conn is not None or not process.is_alive() or time.monotonic() > deadline:
            return conn
