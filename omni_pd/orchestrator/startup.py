"""The orchestrator's start-up and shutdown: the stage config loaded and checked before any worker
starts, the P/D pair's handoff policy and breakers, the stage input processors, torch's threads
in this process, and every stage's workers (each replica's, on Ray where a stage asks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import PipelineConfig, load_deploy_config, load_pipeline_config
from ..config.cpu_checks import check_host_cpus
from ..config.devices import check_devices
from ..config.engine_keys import unused_by_hf
from ..config.model_tp import check_pair_tp_for_model
from ..config.replicas import replica_configs
from ..config.schema import StageConfig
from ..paths import default_stage_config
from ..planning.pd import HandoffPolicy, PDPair, handoff_policy
from .breaker import CircuitBreaker
from .processors import import_processor, stream_processors
from .replicas import StagePool
from .stage_client import StageClient
from .threads import orchestrator_threads, stage_threads, worker_threads

log = logging.getLogger(__name__)


def load_config(
    stage_configs_path: str | Path | None, deploy_config: str | Path | None, device: str, model: str
) -> tuple[Path, PipelineConfig]:
    """The stage config's path and the config, its devices, its workers' CPUs and the P/D pair's TP
    checked against this host and the model."""
    if stage_configs_path is not None and deploy_config is not None:
        raise ValueError("pass stage_configs_path or deploy_config, not both")
    # Either schema loads from stage_configs_path (told by its keys); deploy_config insists
    # on vllm-omni 0.30's deploy schema.
    path = Path(deploy_config or stage_configs_path or default_stage_config())
    config: PipelineConfig = (load_deploy_config if deploy_config is not None else load_pipeline_config)(path)
    config = check_devices(config, device)  # before any worker starts
    check_host_cpus(config, str(path))
    check_pair_tp_for_model(config, model, str(path))
    return path, config


def plan_handoff(
    pair: PDPair | None, stages: Mapping[int, StageConfig]
) -> tuple[HandoffPolicy | None, dict[tuple[int, int], CircuitBreaker]]:
    """The P/D pair's handoff policy and its breakers, one per (prefill replica, decode replica):
    a bad link opens only its own. (None, {}) without a pair."""
    if not pair:
        return None, {}
    handoff = handoff_policy(pair)
    x = stages[pair.prefill_stage_id].runtime.num_replicas
    y = stages[pair.decode_stage_id].runtime.num_replicas
    breakers: dict[tuple[int, int], CircuitBreaker] = {}
    for p in range(x):
        for d in range(y):
            breakers[(p, d)] = CircuitBreaker(
                handoff.breaker_threshold,
                handoff.breaker_cooldown_s,
                "P/D handoff" if x * y == 1 else f"P/D handoff p{p}->d{d}",
            )
    log.info(
        "prefill/decode pair detected: stage %d prefills (%d replica%s), stage %d "
        "decodes (%d replica%s); handoff miss window %g s, deadline %g s, breaker after "
        "%d failures (cooldown %g s), fallback %s",
        pair.prefill_stage_id,
        x,
        "" if x == 1 else "s",
        pair.decode_stage_id,
        y,
        "" if y == 1 else "s",
        handoff.miss_window_s,
        handoff.deadline_s,
        handoff.breaker_threshold,
        handoff.breaker_cooldown_s,
        handoff.fallback,
    )
    return handoff, breakers


def note_unused_engine_keys(config: PipelineConfig) -> None:
    for stage in config.stages:  # keys from a vllm-omni file: said once, not ignored
        if stage.engine == "hf" and (unused := unused_by_hf(set(stage.engine_args.model_fields_set))):
            log.info(
                "stage %d (%s, hf engine) does not use %s",
                stage.stage_id,
                stage.model_stage,
                "; ".join(f"{k} ({why})" for k, why in unused),
            )


def load_processors(config: PipelineConfig) -> tuple[dict[int, Any], dict[int, Any]]:
    """Each stage's input processor, and the streamed edges' stream processors."""
    processors = {
        s.stage_id: import_processor(s.custom_process_input_func)
        for s in config.stages
        if s.custom_process_input_func
    }
    streamed = stream_processors(config)
    if config.async_chunk:
        log.info(
            "async_chunk: stages %s start with their source stage and take its output in chunks",
            sorted(streamed) or "(none)",
        )
    return processors, streamed


class Workers:
    """Every stage's pool of workers, the Ray connection they hold, and torch's thread count in
    this process while they work; `close` gives all three back."""

    def __init__(self) -> None:
        self.pools: dict[int, StagePool] = {}  # emptied in place at close: the router reads it
        self.on_ray = False  # holds the Ray connection (released at close)
        self.torch_threads_before: int | None = None

    def set_orchestrator_threads(self, config: PipelineConfig) -> None:
        wanted = orchestrator_threads(config.stages)
        if wanted is not None and torch.get_num_threads() != wanted:
            # Restored by close(): a library user's process gets its own setting back.
            self.torch_threads_before = torch.get_num_threads()
            torch.set_num_threads(wanted)
            log.info(
                "orchestrator: torch runs on %d thread here (was %d) while the stages work "
                "in their own processes",
                wanted,
                self.torch_threads_before,
            )

    def start(
        self,
        config: PipelineConfig,
        stages: Mapping[int, StageConfig],
        order: list[int],
        model: str,
        startup_timeout_s: float,
    ) -> None:
        """Every stage's workers (each replica's), on Ray where a stage asks; on any failure
        those already started are stopped."""
        threads = stage_threads(config.stages)
        try:
            if any(s.engine_args.distributed_executor_backend == "ray" for s in config.stages):
                from . import ray_workers

                ray_workers.acquire_cluster()
                self.on_ray = True
            # Start every worker first, then wait: the stages load their models in parallel.
            for stage_id in order:
                configs = replica_configs(stages[stage_id])
                self.pools[stage_id] = StagePool(stage_id, [])
                for k, replica_config in enumerate(configs):
                    self.pools[stage_id].add(
                        StageClient(
                            replica_config,
                            model,
                            startup_timeout_s,
                            worker_threads(replica_config, threads[stage_id]),
                            replica=k if len(configs) > 1 else None,
                        )
                    )
            for client in self.all_clients():
                client.wait_ready()
        except BaseException:
            self.close()
            raise
        workers = sum(len(pool) for pool in self.pools.values())
        log.info("all %d stages are up (%d workers)", len(self.pools), workers)

    def all_clients(self) -> list[StageClient]:
        return [client for pool in self.pools.values() for client in pool.clients]

    def close(self) -> None:
        clients = self.all_clients()
        self.pools.clear()
        for client in clients:
            client.request_shutdown()
        for client in clients:
            try:
                client.close()
            except Exception:  # keep closing the others
                log.exception("closing %s failed", client.name)
        before, self.torch_threads_before = self.torch_threads_before, None
        if before is not None:
            torch.set_num_threads(before)
        if self.on_ray:
            self.on_ray = False
            from . import ray_workers

            ray_workers.release_cluster()
