"""`AsyncOmni`: the orchestrator both `Omni` and the server run on.

Every stage worker serves many requests at once (its engine batches them), so the orchestrator
holds no per-stage lock: a request is sent to a stage as soon as its input is ready, and each
stage client matches the worker's answers to the waiting requests. With a P/D pair the thinker
runs twice: a prefill leg (stop conditions neutralised, KV published) and a decode leg (KV
fetched over Mooncake); then the prefill leg's KV lease is released.

Faults: a dead worker is restarted by its stage client, and requests that need it wait for it
within their deadline. The handoff is bounded (`kv_miss_window_s`, `kv_handoff_deadline_s`);
failed handoffs open the pair's breaker, and the pair's `kv_fallback` decides what a request
that cannot use the prefill side gets: the decode engine computes the prompt itself
(`local_prefill`, output identical to colocated) or a named error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence, cast

import torch

from .. import registry
from ..config import PipelineConfig, load_deploy_config, load_pipeline_config
from ..config.devices import check_devices
from ..config.model_tp import check_pair_tp_for_model
from ..config.replicas import replica_configs
from ..config.engine_keys import unused_by_hf
from ..engines.base import StageInputs
from ..engines.types import AudioOutput, TextOutput, TokenPrompt
from ..kv.push import TARGET_KEY
from ..paths import default_stage_config
from ..planning import (
    build_decode_sampling_params,
    build_prefill_sampling_params,
    expand_sampling_params,
    find_pd_pair,
    new_transfer_id,
)
from ..planning.pd import PDPair, handoff_policy
from ..sampling import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .graph import topological_order
from .outputs import OmniRequestOutput
from .processors import import_processor, stream_processors
from .breaker import CircuitBreaker
from .replicas import StagePool
from .request_io import (
    AudioDelta,
    Finished,
    HandoffFailed,
    PreparedPrompt,
    PromptTooLong,
    RequestAborted,
    RequestTimeout,
    TextDelta,
)
from .request_state import RequestState
from .stage_client import StageClient, StageError, StageTimeout
from .threads import orchestrator_threads, stage_threads

log = logging.getLogger(__name__)
DEFAULT_REQUEST_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
MODALITIES = frozenset({"text", "audio"})
RELEASE_KV_TIMEOUT_S = 2.0  # an unreleased lease expires on its own (kv_lease_timeout_s)
CONTROL_TIMEOUT_S = 5.0  # a stage that does not answer a state query within this is reported
# How a worker names a failed KV handoff (the exception class in front of its message).
HANDOFF_FAILURES = frozenset(
    {"KVTransferError", "KVMissError", "KVIntegrityError", "KVIncompatibleError", "KVTransferFailed"}
)


class AsyncOmni:
    def __init__(
        self,
        model: str | None = None,
        stage_configs_path: str | Path | None = None,
        *,
        deploy_config: str | Path | None = None,
        keep_stage_outputs: bool = False,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        device: str = "auto",
    ):
        """`device`: "auto" runs an hf stage on the GPU its `runtime.devices` names (refused
        before any worker starts where torch sees no such GPU, and for tensor parallelism);
        "cpu" runs every hf stage on the CPU anyway. `model`: an
        embedded model's name or a checkpoint directory (omni_pd.registry finds the package that
        serves it); None serves the default embedded model."""
        model = model or registry.default_model()
        self.model = model
        self._load_config(stage_configs_path, deploy_config, device)
        self.keep_stage_outputs = keep_stage_outputs
        self.request_timeout_s = request_timeout_s
        self.stages = {s.stage_id: s for s in self.config.stages}
        self.order = topological_order({s.stage_id: tuple(s.engine_input_source) for s in self.config.stages})
        self._plan_pd_pair()
        self._background: set[asyncio.Task] = set()  # KV releases nobody waits for
        self._warned_incompatible = False
        self._note_unused_engine_keys()
        self._load_pipeline(model)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.pools: dict[int, StagePool] = {}
        self._torch_threads_before: int | None = None
        self._set_orchestrator_threads()
        self._on_ray = False  # holds the Ray connection (released at close)
        self._start_workers(model, startup_timeout_s)

    def _load_config(
        self, stage_configs_path: str | Path | None, deploy_config: str | Path | None, device: str
    ) -> None:
        if stage_configs_path is not None and deploy_config is not None:
            raise ValueError("pass stage_configs_path or deploy_config, not both")
        # Either schema loads from stage_configs_path (told by its keys); deploy_config insists
        # on vllm-omni 0.30's deploy schema.
        self.stage_configs_path = Path(deploy_config or stage_configs_path or default_stage_config())
        self.config: PipelineConfig = (
            load_deploy_config if deploy_config is not None else load_pipeline_config
        )(self.stage_configs_path)
        self.config = check_devices(self.config, device)  # before any worker starts
        check_pair_tp_for_model(self.config, self.model, str(self.stage_configs_path))

    @property
    def _pair(self) -> PDPair:
        """The P/D pair, for the code that runs only in a pipeline that has one (the handoff's)."""
        assert self.pd_pair is not None, "this pipeline has no P/D pair"
        return self.pd_pair

    def _plan_pd_pair(self) -> None:
        """The P/D pair, if the config has one, with its handoff policy and breakers."""
        self.pd_pair = find_pd_pair(self.config)
        # One breaker per (prefill replica, decode replica): a bad link opens only its own.
        self.breakers: dict[tuple[int, int], CircuitBreaker] = {}
        self.handoff_failures = self.fallbacks = 0
        if not self.pd_pair:
            return
        self.handoff = handoff_policy(self.pd_pair)
        x = self.stages[self.pd_pair.prefill_stage_id].runtime.num_replicas
        y = self.stages[self.pd_pair.decode_stage_id].runtime.num_replicas
        for p in range(x):
            for d in range(y):
                self.breakers[(p, d)] = CircuitBreaker(
                    self.handoff.breaker_threshold,
                    self.handoff.breaker_cooldown_s,
                    "P/D handoff" if x * y == 1 else f"P/D handoff p{p}->d{d}",
                )
        log.info(
            "prefill/decode pair detected: stage %d prefills (%d replica%s), stage %d "
            "decodes (%d replica%s); handoff miss window %g s, deadline %g s, breaker after "
            "%d failures (cooldown %g s), fallback %s",
            self.pd_pair.prefill_stage_id,
            x,
            "" if x == 1 else "s",
            self.pd_pair.decode_stage_id,
            y,
            "" if y == 1 else "s",
            self.handoff.miss_window_s,
            self.handoff.deadline_s,
            self.handoff.breaker_threshold,
            self.handoff.breaker_cooldown_s,
            self.handoff.fallback,
        )

    def _note_unused_engine_keys(self) -> None:
        for stage in self.config.stages:  # keys from a vllm-omni file: said once, not ignored
            if stage.engine == "hf" and (unused := unused_by_hf(set(stage.engine_args.model_fields_set))):
                log.info(
                    "stage %d (%s, hf engine) does not use %s",
                    stage.stage_id,
                    stage.model_stage,
                    "; ".join(f"{k} ({why})" for k, why in unused),
                )

    def _load_pipeline(self, model: str) -> None:
        """The model's side in this process: its tokenizer, context and stage input processors."""
        self.pipeline: registry.ModelPipeline = registry.load_pipeline(model)
        self.text_stage_id = self._final_stage("text")
        self.model_config = self.pipeline.config
        self.tokenizer = self.pipeline.tokenizer
        self.max_model_len = (
            self.stages[self.text_stage_id].engine_args.max_model_len or self.pipeline.context_len
        )
        self.processors = {
            s.stage_id: import_processor(s.custom_process_input_func)
            for s in self.config.stages
            if s.custom_process_input_func
        }
        self.stream_processors = stream_processors(self.config)
        if self.config.async_chunk:
            log.info(
                "async_chunk: stages %s start with their source stage and take its output in chunks",
                sorted(self.stream_processors) or "(none)",
            )

    def _set_orchestrator_threads(self) -> None:
        wanted = orchestrator_threads(self.config.stages)
        if wanted is not None and torch.get_num_threads() != wanted:
            # Restored by close(): a library user's process gets its own setting back.
            self._torch_threads_before = torch.get_num_threads()
            torch.set_num_threads(wanted)
            log.info(
                "orchestrator: torch runs on %d thread here (was %d) while the stages work "
                "in their own processes",
                wanted,
                self._torch_threads_before,
            )

    def _start_workers(self, model: str, startup_timeout_s: float) -> None:
        """Every stage's workers (each replica's), on Ray where a stage asks; on any failure
        those already started are stopped."""
        threads = stage_threads(self.config.stages)
        try:
            if any(s.engine_args.distributed_executor_backend == "ray" for s in self.config.stages):
                from . import ray_workers

                ray_workers.acquire_cluster()
                self._on_ray = True
            # Start every worker first, then wait: the stages load their models in parallel.
            for stage_id in self.order:
                configs = replica_configs(self.stages[stage_id])
                self.pools[stage_id] = StagePool(stage_id, [])
                for k, config in enumerate(configs):
                    self.pools[stage_id].add(
                        StageClient(
                            config,
                            model,
                            startup_timeout_s,
                            threads[stage_id],
                            replica=k if len(configs) > 1 else None,
                        )
                    )
            for client in self._all_clients():
                client.wait_ready()
        except BaseException:
            self.close()
            raise
        workers = sum(len(pool) for pool in self.pools.values())
        log.info("all %d stages are up (%d workers)", len(self.pools), workers)

    @property
    def clients(self) -> dict[int, StageClient]:
        """Each stage's first replica (its only one, unless num_replicas says otherwise)."""
        return {stage_id: pool.first for stage_id, pool in self.pools.items()}

    @property
    def breaker(self) -> CircuitBreaker | None:
        """The first P/D link's breaker (1P1D: the pair's only one)."""
        return self.breakers.get((0, 0))

    def _all_clients(self) -> list[StageClient]:
        return [client for pool in self.pools.values() for client in pool.clients]

    def _final_stage(self, kind: str) -> int:
        finals = [s.stage_id for s in self.config.stages if s.final_output and s.final_output_type == kind]
        if finals:
            return finals[-1]
        text_stage = self.pipeline.text_model_stage
        return [s.stage_id for s in self.config.stages if s.model_stage == text_stage][-1]

    def _stages_for(self, modalities: frozenset[str]) -> list[int]:
        """The stages a request needs: up to the text stage for text alone, all for audio."""
        if "audio" in modalities:
            return list(self.order)
        needed, todo = set(), [self.text_stage_id]
        while todo:
            stage_id = todo.pop()
            if stage_id not in needed:
                needed.add(stage_id)
                todo.extend(self.stages[stage_id].engine_input_source)
        return [s for s in self.order if s in needed]

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        clients, self.pools = self._all_clients(), {}
        for client in clients:
            client.request_shutdown()
        for client in clients:
            try:
                client.close()
            except Exception:  # keep closing the others
                log.exception("closing %s failed", client.name)
        before, self._torch_threads_before = self._torch_threads_before, None
        if before is not None:
            torch.set_num_threads(before)
        if self._on_ray:
            self._on_ray = False
            from . import ray_workers

            ray_workers.release_cluster()

    @property
    def closed(self) -> bool:
        return not self.pools

    @property
    def worker_pids(self) -> list[int]:
        return [c.process.pid for c in self._all_clients() if c.process is not None]

    async def control(
        self, stage_id: int, name: str, timeout_s: float = 30.0, replica: int = 0, **kwargs: Any
    ) -> Any:
        return await self.pools[stage_id].clients[replica].control_async(name, timeout_s, **kwargs)

    async def debug_state_counts(self) -> dict[str, int]:
        """Per-request state on every side: all zero when no request is in flight. Keys name the
        stage (`stage0.`), and the replica where a stage has several (`stage0.r1.`); one that
        cannot answer (restarting, down, frozen) shows as `<that>.unreachable: 1`."""
        counts = {
            "orchestrator.requests": len(self._requests),
            "orchestrator.replica_assignments": sum(sum(pool.in_flight) for pool in self.pools.values()),
        }
        for stage_id, pool in list(self.pools.items()):
            for client in pool.clients:
                try:
                    answer = await client.control_async("debug_state_counts", CONTROL_TIMEOUT_S)
                except StageError:
                    counts[f"{client.tag}.unreachable"] = 1
                    continue
                for key, value in answer.items():
                    counts[f"{client.tag}.{key}"] = value
        return counts

    def _replica_health(self, client: StageClient) -> dict[str, Any]:
        why = client.unavailable()
        return {
            "status": client.status.value,
            "responsive": why is None,
            "restarts": client.restarts,
            "pid": client.process.pid if client.process is not None else None,
            "reason": str(why) if why is not None else "",
        }

    def health(self) -> dict[str, Any]:
        """Each stage's status (up, restarting, down, silent) and why, and each replica's with
        its load; "ok" when every worker is up and answering. The server's /health answers 503
        unless ok, though a stage with one replica up still serves."""
        stages: dict[str, Any] = {}
        for stage_id, pool in self.pools.items():
            replicas = [{**self._replica_health(c), "load": pool.load(k)} for k, c in enumerate(pool.clients)]
            worst = next((r for r in replicas if not r["responsive"]), replicas[0])
            stages[str(stage_id)] = {
                "name": self._stage_name(stage_id),
                "status": worst["status"],
                "responsive": all(r["responsive"] for r in replicas),
                "serving": any(r["responsive"] for r in replicas),
                "restarts": sum(r["restarts"] for r in replicas),
                "pid": replicas[0]["pid"],
                "reason": "; ".join(
                    f"replica {k}: {r['reason']}" if len(replicas) > 1 else r["reason"]
                    for k, r in enumerate(replicas)
                    if r["reason"]
                ),
                "replicas": replicas,
            }
        report: dict[str, Any] = {
            "status": "ok" if all(s["responsive"] for s in stages.values()) else "degraded",
            "stages": stages,
        }
        if self.breakers:
            states = {f"p{p}->d{d}": b.state.value for (p, d), b in self.breakers.items()}
            worst_state = next((v for v in states.values() if v != "closed"), "closed")
            report["kv_handoff"] = {
                "breaker": worst_state,
                "breakers": states,
                "failures": self.handoff_failures,
                "fallbacks": self.fallbacks,
            }
        return report

    # ---- requests --------------------------------------------------------------------------
    def stage_params(
        self, sampling_params_list: Sequence[SamplingParams | None] | None
    ) -> dict[int, SamplingParams]:
        ordered = [s.stage_id for s in self.config.stages]
        given = list(sampling_params_list) if sampling_params_list is not None else [None] * len(ordered)
        if len(given) != len(ordered):
            # One entry per logical stage (the thinker counted once): the decode leg gets a copy.
            given = expand_sampling_params(given, self.config)
        return {
            sid: p if p is not None else self.stages[sid].default_sampling_params
            for sid, p in zip(ordered, given)
        }

    @staticmethod
    def _with_seeds(params: dict[int, SamplingParams]) -> dict[int, SamplingParams]:
        # An unseeded sampled request gets one random seed, shared by every leg of its stage, so
        # that a P/D pair samples exactly as one engine would.
        seed = secrets.randbelow(2**31)
        return {
            sid: p if p.seed is not None or p.greedy else p.replace(seed=seed) for sid, p in params.items()
        }

    def prepare(self, prompt: Any) -> PreparedPrompt:
        """Normalize and build a prompt for the text stage: CPU work (tokenizing, audio features)
        for a thread, whose result `generate` / `stream` take as the prompt."""
        normalized = self.pipeline.normalize_prompt(prompt)
        prepared = PreparedPrompt(normalized, self.pipeline.build_prompt(normalized))
        self._check_multimodal(prepared.text_prompt)
        return prepared

    def _check_multimodal(self, text_prompt: TokenPrompt) -> None:
        """A prompt with audio (or images) is refused up front, as a bad request, when a stage
        that may compute it cannot take it (its engine says so when it starts)."""
        if not text_prompt.has_multimodal_inputs():
            return
        takers = [s.stage_id for s in self.config.stages if not s.engine_input_source]
        if self.pd_pair:  # its decode leg prefills the prompt itself on the local fallback
            takers.append(self.pd_pair.decode_stage_id)
        for stage_id in takers:
            if not self.pools[stage_id].first.info.get("takes_multimodal_prompts", True):
                stage = self.stages[stage_id]
                raise ValueError(
                    f"stage {stage_id} ({self._stage_name(stage_id)}, engine "
                    f"{stage.engine}) takes text prompts only: remove the audio from "
                    "the prompt, or run that stage with engine: hf"
                )

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{secrets.token_hex(4)}"

    def abort(self, request_id: str) -> None:
        """Stop a request: the stage running it stops at its next token, later stages never run,
        and its KV lease is released. Unknown or finished requests are ignored."""
        state = self._requests.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        log.debug("request %s aborted", request_id)
        for stage_id in list(state.active_stages):  # every stage of a streamed group at once
            assignment = state.replicas.get(stage_id)
            if assignment is not None and not self.closed:
                assignment.client.abort(request_id)

    async def generate(
        self,
        prompt: Any,
        sampling_params_list: Sequence[SamplingParams | None] | None = None,
        *,
        request_id: str | None = None,
        modalities: Sequence[str] = ("text", "audio"),
        on_text: Callable[[str], None] | None = None,
        on_audio: Callable[[torch.Tensor, int], None] | None = None,
    ) -> OmniRequestOutput:
        if self.closed:
            raise RuntimeError("this Omni is closed")
        wanted = frozenset(modalities)
        if not wanted or not wanted <= MODALITIES or "text" not in wanted:
            raise ValueError(f"modalities must be ['text'] or ['text', 'audio'], got {sorted(wanted)}")
        params = self._with_seeds(self.stage_params(sampling_params_list))
        prepared = prompt if isinstance(prompt, PreparedPrompt) else None
        state = RequestState(
            request_id=request_id or self.new_request_id(),
            prompt=prepared.prompt if prepared else self.pipeline.normalize_prompt(prompt),
            params=params,
        )
        if state.request_id in self._requests:
            raise ValueError(f"request id {state.request_id} is already in flight")
        self._requests[state.request_id] = state
        try:
            return await self._run(
                state, self._stages_for(wanted), on_text, on_audio, prepared.text_prompt if prepared else None
            )
        finally:
            self._release_kv(state)  # sent now, its answer awaited in the background
            self._release_push(state)
            state.release_replicas()
            del self._requests[state.request_id]

    async def stream(
        self,
        prompt: Any,
        sampling_params_list=None,
        *,
        request_id: str | None = None,
        modalities: Sequence[str] = ("text", "audio"),
    ) -> AsyncIterator[TextDelta | AudioDelta | Finished]:
        """Text deltas as the text stage produces them and audio deltas as code2wav produces them
        (interleaved), then the finished output. The deltas add up to the finished output's text
        and audio. Closing the iterator early aborts the request."""
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(
            self.generate(
                prompt,
                sampling_params_list,
                request_id=request_id,
                modalities=modalities,
                on_text=lambda text: queue.put_nowait(TextDelta(text)),
                on_audio=lambda audio, rate: queue.put_nowait(AudioDelta(audio, rate)),
            )
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))
        sent, samples_sent = "", 0
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, TextDelta):
                    sent += item.text
                else:
                    samples_sent += item.audio.numel()
                yield item
            output = task.result()
            if output.text.startswith(sent) and len(output.text) > len(sent):
                yield TextDelta(output.text[len(sent) :])  # what the deltas held back
            if output.audio is not None and output.audio.numel() > samples_sent:
                assert output.sample_rate is not None, "an output's audio comes with its sample rate"
                # Without streaming between stages the audio exists only now, in one piece.
                yield AudioDelta(output.audio[samples_sent:], output.sample_rate)
            yield Finished(output)
        finally:
            if not task.done():
                self.abort(request_id)
                await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved: an aborted request's error is expected here

    def _streamed_groups(self, stage_ids: list[int]) -> list[list[int]]:
        """Consecutive stages joined by streamed edges run as one group, all at once."""
        groups: list[list[int]] = []
        for stage_id in stage_ids:
            if (
                groups
                and stage_id in self.stream_processors
                and self.stages[stage_id].engine_input_source == (groups[-1][-1],)
            ):
                groups[-1].append(stage_id)
            else:
                groups.append([stage_id])
        return groups

    async def _run(
        self,
        state: RequestState,
        stage_ids: list[int],
        on_text: Callable[[str], None] | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
        text_prompt: TokenPrompt | None = None,
    ) -> OmniRequestOutput:
        deadline = time.monotonic() + self.request_timeout_s
        if text_prompt is None:
            # Tokenizing (and extracting audio features) is CPU work: off the event loop, which
            # serves every other request meanwhile.
            # build_prompt gives a TokenPrompt; the registry types it Any, as it imports no layer above it.
            text_prompt = cast(TokenPrompt, await asyncio.to_thread(self.pipeline.build_prompt, state.prompt))
        self._check_multimodal(text_prompt)
        prompt_len = state.prompt_len = len(text_prompt.prompt_token_ids)
        max_tokens = state.params[self.text_stage_id].max_tokens
        if prompt_len + max_tokens > self.max_model_len:
            raise PromptTooLong.of(prompt_len, max_tokens, self.max_model_len)
        for group in self._streamed_groups(stage_ids):
            if state.aborted:
                raise RequestAborted(f"request {state.request_id} was aborted")
            if state.silent:
                break  # an answer with nothing to speak: the stages after the text stage skip it
            try:
                if self.pd_pair and group == [self.pd_pair.prefill_stage_id]:
                    await self._prefill_leg(state, text_prompt, deadline, on_text)
                    continue
                for stage_id in group:  # restarting or silent stages: wait, within the deadline
                    await self._usable_replica(state, stage_id, deadline)
                if len(group) == 1:
                    await self._run_stage(state, group[0], text_prompt, deadline, on_text)
                else:
                    await self._run_streamed(state, group, text_prompt, deadline, on_text, on_audio)
            except StageError:
                if state.aborted:
                    raise RequestAborted(f"request {state.request_id} was aborted") from None
                raise
            if self.pd_pair and self.pd_pair.decode_stage_id in group:
                self._release_kv(state)
        return self._finish(state)

    # ---- the P/D handoff ---------------------------------------------------------------------
    async def _prefill_leg(
        self,
        state: RequestState,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        """Run the prefill leg within the miss window, or decide that the decode leg computes the
        prompt itself (the breaker is open, the prefill worker is down or silent, or the leg
        failed); with kv_fallback 'error' that decision is a HandoffFailed instead. A streamed
        request's first token leaves as soon as the prefill leg has it: the KV handoff is not on
        its time to first token (the decode leg's stream starts with the same token, skipped)."""
        pair, policy = self._pair, self.handoff
        # The decode replica first: the prefill replica is the best one whose link to it is up.
        self._route(state, pair.decode_stage_id)
        decode = state.replicas[pair.decode_stage_id].index
        pool = self.pools[pair.prefill_stage_id]
        tokens, positions = self._footprint(state, pair.prefill_stage_id)
        ranked = pool.ranked(tokens, positions)
        if not ranked:
            return self._no_remote(state, str(pool.unavailable()))
        chosen = next((p for p in ranked if self.breakers[(p, decode)].allow()), None)
        if chosen is None:
            breaker = self.breakers[(ranked[0], decode)]
            return self._no_remote(
                state,
                f"the {breaker.name} breaker is {breaker.state.value} "
                f"after {breaker.consecutive_failures} failed handoffs",
            )
        state.replicas[pair.prefill_stage_id] = pool.assign(chosen, tokens)
        self._log_route(state, pair.prefill_stage_id)
        client = pool.clients[chosen]
        now = time.monotonic()
        state.handoff_deadline = min(now + policy.deadline_s, deadline)
        if policy.transfer_mode == "push":
            await self._reserve_push(
                state, text_prompt, min(now + policy.miss_window_s, state.handoff_deadline)
            )
        try:
            await self._run_stage(
                state,
                pair.prefill_stage_id,
                text_prompt,
                min(now + policy.miss_window_s, state.handoff_deadline),
                None,
            )
        except StageError as exc:
            if state.aborted:
                raise RequestAborted(f"request {state.request_id} was aborted") from None
            self._handoff_failed(
                state,
                str(exc)
                if not isinstance(exc, StageTimeout)
                else (
                    f"{client.name} did not publish the KV within the miss window "
                    f"(kv_miss_window_s {policy.miss_window_s:g} s)"
                ),
            )
            return
        first = state.outputs[pair.prefill_stage_id].token_ids[:1]
        if first:
            state.first_token_at = state.elapsed_ms()  # the request's first token exists now
        if on_text is not None and first:
            # The decode leg (or its local-prefill fallback) starts from this same token.
            self._text_stream(state, state.params[pair.decode_stage_id], on_text)(first)
            state.tokens_streamed_early = len(first)

    async def _reserve_push(self, state: RequestState, text_prompt: TokenPrompt, until: float) -> None:
        """Push mode: reserve the request's blocks on its decode replica for the prefill leg to
        write into. A replica that cannot (no room, restarting, slow to answer) leaves the
        request to pull, as the pair does in pull mode."""
        decode_id = self._pair.decode_stage_id
        state.transfer_id = new_transfer_id(state.request_id)
        client = state.replicas[decode_id].client
        try:
            future = client.control_future(
                "reserve_kv",
                transfer_id=state.transfer_id,
                prompt=text_prompt.tokens_only(),
                params=state.params[decode_id],
                wait_s=max(until - time.monotonic(), 0.0),
            )
            state.push_target = await client.await_call(
                future, "reserve_kv", max(until - time.monotonic(), 0.0)
            )
        except StageError as exc:
            log.debug("request %s: no push reservation (%s); the decode leg pulls", state.request_id, exc)
            self._release_push(state)

    def _release_push(self, state: RequestState, writer_gone: bool = False) -> None:
        """Push mode: give the decode replica's reservation up (the prefill leg failed, or the
        request left before its decode leg took it). Sent now, answered in the background."""
        if state.push_target is None or self.closed:
            return
        state.push_target = None
        client = state.replicas[self._pair.decode_stage_id].client
        try:
            future = client.control_future(
                "release_push", transfer_id=state.transfer_id, writer_gone=writer_gone
            )
        except StageError as exc:  # restarting or down: its reservations went with the old worker
            log.debug("request %s: push reservation not released (%s)", state.request_id, exc)
            return
        task = asyncio.ensure_future(self._await_control(client, future, "release_push", state))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _await_control(client: StageClient, future, name: str, state: RequestState) -> None:
        try:
            await client.await_call(future, name, RELEASE_KV_TIMEOUT_S)
        except StageError as exc:
            log.debug("request %s: %s not answered (%s)", state.request_id, name, exc)

    def _handoff_failed(self, state: RequestState, why: str) -> None:
        self.handoff_failures += 1
        self._link_breaker(state).failure(why)
        self._release_kv(state)
        self._release_push(state, writer_gone=self._prefill_gone(state))
        state.outputs.pop(self._pair.prefill_stage_id, None)
        state.stage_spans.pop(self._pair.prefill_stage_id, None)
        self._no_remote(state, why)

    def _prefill_gone(self, state: RequestState) -> bool:
        """Whether the request's prefill worker is down (it cannot write a late push)."""
        assignment = state.replicas.get(self._pair.prefill_stage_id)
        return assignment is not None and assignment.client.unavailable() is not None

    def _no_remote(self, state: RequestState, why: str) -> None:
        if self.handoff.fallback == "error":
            raise HandoffFailed(
                f"request {state.request_id}: the KV handoff from "
                f"{self._prefill_name(state)} is not "
                f"possible ({why}); kv_fallback is 'error' (set kv_fallback: "
                "local_prefill to let the decode engine compute such prompts)",
                self.handoff.breaker_cooldown_s,
            )
        self.fallbacks += 1
        state.local_prefill = True
        log.debug("request %s: the decode engine computes the prompt itself (%s)", state.request_id, why)

    async def _run_stage(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any:
        began = time.perf_counter()
        state.active_stages.add(stage_id)
        state.stage_started(stage_id)
        try:
            output = await self._stage_call(state, stage_id, text_prompt, deadline, on_text, on_chunk)
        finally:
            state.active_stages.discard(stage_id)
            if stage_id in state.replicas:  # no longer this replica's load
                state.replicas[stage_id].release()
        state.stage_finished(stage_id, began, output)
        if stage_id == self.text_stage_id and not self.pipeline.speaks(output):
            state.silent = True
            log.debug(
                "request %s: the answer has nothing to speak (%d token); no audio",
                state.request_id,
                len(output.token_ids),
            )
        if (
            stage_id == self.text_stage_id
            and "first_token_ms" in output.metrics
            and state.first_token_at is None
        ):
            state.first_token_at = (began - state.started) * 1e3 + output.metrics["first_token_ms"]
        return output

    async def _run_streamed(
        self,
        state: RequestState,
        group: list[int],
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
    ) -> None:
        """Run a group of stages at once. The first starts from its finished input; each later
        one is fed its source's chunks through its stream processor, starts as soon as that has
        an opening prompt, and gets the rest of its input as it comes."""
        await _StreamedGroup(self, state, group, text_prompt, deadline, on_text, on_audio).run()

    def _stage_inputs(self, state: RequestState, stage_id: int) -> StageInputs:
        stage = self.stages[stage_id]
        return StageInputs(
            request_id=state.request_id,
            stage_id=stage_id,
            source_stage_ids=tuple(stage.engine_input_source),
            # live: a stream processor made before a P/D fallback sees the
            # prefill leg's output go
            upstream=state.outputs,
            model_config=self.model_config,
            speaker=state.prompt.speaker,
            engine_args=stage.engine_args,
        )

    async def _stage_call(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any:
        stage = self.stages[stage_id]
        params = state.params[stage_id]
        prompt: Any = text_prompt
        pair = self.pd_pair
        if pair and stage_id == pair.prefill_stage_id:
            if state.push_target is None:  # a push reservation named the transfer already
                state.transfer_id = new_transfer_id(state.request_id)
            assert state.transfer_id is not None, "set by the push reservation or just above"
            params = build_prefill_sampling_params(params, state.transfer_id)
            if state.push_target is not None:
                params = params.replace(
                    kv_transfer_params={**(params.kv_transfer_params or {}), TARGET_KEY: state.push_target}
                )
        elif pair and stage_id == pair.decode_stage_id and not state.local_prefill:
            return await self._remote_decode(state, text_prompt, deadline, on_text, on_chunk)
        elif pair and stage_id == pair.decode_stage_id:
            pass  # the fallback: the decode engine computes the whole prompt, as colocated
        elif stage.engine_input_source:
            prompt = self.processors[stage_id](self._stage_inputs(state, stage_id))
        on_tokens = None
        if on_text is not None and stage_id == self.text_stage_id:
            on_tokens = self._text_stream(state, params, on_text)
        remaining = self._time_left(state, deadline, stage_id)
        return await self._route(state, stage_id).generate(
            state.request_id, prompt, params, remaining, on_tokens, on_chunk
        )

    async def _remote_decode(
        self,
        state: RequestState,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None,
        on_chunk: Callable[[Any], None] | None,
    ) -> Any:
        """The decode leg with the prefill leg's KV. A failed handoff (a KV read that missed its
        window, a corrupted block, an incompatible peer) fails before the leg produces anything,
        so the request is run again on the fallback path."""
        pair = self._pair
        decode_id = pair.decode_stage_id
        prefill_out = state.outputs[pair.prefill_stage_id]
        assert state.transfer_id is not None, "the prefill leg set the transfer id"
        params = build_decode_sampling_params(
            state.params[decode_id], prefill_out.kv_transfer_params or {}, state.transfer_id
        )
        assert params.kv_transfer_params is not None, "build_decode_sampling_params sets them"
        wait_s = min(
            self.handoff.miss_window_s, state.handoff_deadline - time.monotonic(), deadline - time.monotonic()
        )
        params = params.replace(
            kv_transfer_params={**params.kv_transfer_params, "kv_wait_s": max(wait_s, 0.0)}
        )
        # The KV covers the prompt (audio included): the decode leg needs only the token ids.
        prompt = text_prompt.tokens_only()
        on_tokens = self._text_stream(state, params, on_text) if on_text is not None else None
        remaining = self._time_left(state, deadline, decode_id)
        state.push_target = None  # the decode leg takes (or frees) its reservation now
        try:
            output = await self._route(state, decode_id).generate(
                state.request_id, prompt, params, remaining, on_tokens, on_chunk
            )
        except StageError as exc:
            kind = getattr(exc, "kind", "")
            if kind not in HANDOFF_FAILURES or state.aborted:
                raise
            if kind == "KVIncompatibleError" and not self._warned_incompatible:
                self._warned_incompatible = True  # a deployment error: say it once, loudly
                log.warning(
                    "the P/D pair cannot hand KV on: %s; requests fall back (kv_fallback "
                    "%s) until the stages are made compatible",
                    exc,
                    self.handoff.fallback,
                )
            self._handoff_failed(state, str(exc))
            return await self._stage_call(state, decode_id, text_prompt, deadline, on_text, on_chunk)
        self._link_breaker(state).success()
        return output

    # ---- routing ---------------------------------------------------------------------------
    def _footprint(self, state: RequestState, stage_id: int) -> tuple[int, int]:
        """(prompt tokens, KV positions) the request brings to a stage, for the router: the
        text stage's prompt on a thinker replica, nothing it weighs elsewhere."""
        if self.stages[stage_id].model_stage != self.pipeline.text_model_stage:
            return 0, 0
        return state.prompt_len, state.prompt_len + state.params[stage_id].max_tokens

    def _route(self, state: RequestState, stage_id: int) -> StageClient:
        """The replica of `stage_id` that serves this request, picked by load at first use."""
        assignment = state.replicas.get(stage_id)
        if assignment is None:
            assignment = self.pools[stage_id].pick(*self._footprint(state, stage_id))
            state.replicas[stage_id] = assignment
            self._log_route(state, stage_id)
        return assignment.client

    def _log_route(self, state: RequestState, stage_id: int) -> None:
        pool, k = self.pools[stage_id], state.replicas[stage_id].index
        if len(pool) > 1:
            log.debug("request %s: %s (%s)", state.request_id, pool.clients[k].name, pool.describe_load(k))

    async def _usable_replica(self, state: RequestState, stage_id: int, deadline: float) -> None:
        """Wait (within the deadline) until the request's replica of `stage_id` can take it. A
        replica picked earlier (the decode replica, at the prefill leg) that has gone away since
        is swapped for one that is up: any decode replica can pull the KV."""
        pool = self.pools[stage_id]
        assignment = state.replicas.get(stage_id)
        if (
            assignment is not None
            and len(pool) > 1
            and assignment.client.unavailable() is not None
            and pool.usable()
        ):
            assignment.release()
            del state.replicas[stage_id]
            assignment = None
        if assignment is None:
            await pool.wait_usable(deadline - time.monotonic())
            self._route(state, stage_id)
        else:
            await assignment.client.wait_usable(deadline - time.monotonic())

    def _link_breaker(self, state: RequestState) -> CircuitBreaker:
        pair = self._pair
        return self.breakers[
            (state.replicas[pair.prefill_stage_id].index, state.replicas[pair.decode_stage_id].index)
        ]

    def _prefill_name(self, state: RequestState) -> str:
        assignment = state.replicas.get(self._pair.prefill_stage_id)
        return (
            assignment.client if assignment is not None else self.pools[self._pair.prefill_stage_id].first
        ).name

    def _time_left(self, state: RequestState, deadline: float, stage_id: int) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout(
                f"request {state.request_id} passed its {self.request_timeout_s:.0f} s "
                f"deadline before stage {stage_id}"
            )
        return remaining

    def _text_stream(
        self, state: RequestState, params: SamplingParams, on_text: Callable[[str], None]
    ) -> Callable[[list[int]], None]:
        """The token ids -> text deltas callback for a text stage's stream. One detokenizer per
        request: a stage that streams after the prefill leg's first token went out (the decode
        leg, or its fallback) skips the tokens already streamed."""
        if state.text_stream is None:
            detok = IncrementalDetokenizer(self.tokenizer, params, self.pipeline.eos_token_ids)

            def stream(token_ids: list[int]) -> None:  # on the event loop
                delta = detok.add(token_ids)
                if delta:
                    on_text(delta)

            state.text_stream = stream
            return stream
        skip = state.tokens_streamed_early

        def on_tokens(token_ids: list[int]) -> None:
            nonlocal skip
            dropped, skip = min(skip, len(token_ids)), max(skip - len(token_ids), 0)
            if len(token_ids) > dropped:
                state.text_stream(token_ids[dropped:])

        return on_tokens

    def _release_kv(self, state: RequestState) -> None:
        """Tell the prefill leg it may free the request's KV blocks now rather than at lease
        expiry. Sent at once (so a later state query sees it), answered in the background: the
        request's answer never waits on it."""
        if state.transfer_id is None or state.kv_released or self.closed:
            return
        state.kv_released = True
        client = state.replicas[self._pair.prefill_stage_id].client
        try:
            future = client.control_future("release_kv", transfer_id=state.transfer_id)
        except StageError as exc:  # restarting or down: its leases went with the old worker
            log.debug("request %s: KV lease %s not released (%s)", state.request_id, state.transfer_id, exc)
            return
        task = asyncio.ensure_future(self._await_release(client, future, state))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _await_release(client: StageClient, future, state: RequestState) -> None:
        try:
            await client.await_call(future, "release_kv", RELEASE_KV_TIMEOUT_S)
        except StageError as exc:  # a timeout included: an unreleased lease expires on its own
            log.debug("request %s: KV lease %s not released (%s)", state.request_id, state.transfer_id, exc)

    def _stage_name(self, stage_id: int) -> str:
        stage = self.stages[stage_id]
        role = " prefill" if stage.is_prefill_only else " decode" if stage.is_decode_only else ""
        return stage.model_stage + role

    def _finish(self, state: RequestState) -> OmniRequestOutput:
        text: TextOutput = state.outputs[self.text_stage_id]
        audio_stage, audio = next(
            ((k, o) for k, o in state.outputs.items() if isinstance(o, AudioOutput)), (None, None)
        )
        metrics: dict[str, Any] = {
            "ttft_ms": state.first_token_at,
            "e2e_ms": state.elapsed_ms(),
            "stage_ms": {str(k): v for k, v in state.stage_ms.items()},
            "prompt_tokens": len(text.prompt_token_ids),
            "completion_tokens": len(text.token_ids),
        }
        for key in (
            "kv_bytes_transferred",
            "kv_blocks_transferred",
            "kv_transfer_ms",
            "kv_path",
            "kv_reused_tokens",
            "kv_bytes_reused",
        ):
            if key in text.metrics:
                metrics[key] = text.metrics[key]
        metrics["replicas"] = {str(k): a.index for k, a in sorted(state.replicas.items())}
        # Prompt tokens whose KV came from a prefix cache rather than being computed (the leg
        # that prefilled: colocated, the prefill leg, or the decode leg's local fallback).
        metrics["prefix_cached_tokens"] = max(
            (
                o.metrics.get("prefix_cached_tokens", 0)
                for k, o in state.outputs.items()
                if self.stages[k].model_stage == self.pipeline.text_model_stage
                and isinstance(getattr(o, "metrics", None), dict)
            ),
            default=0,
        )
        if self.pd_pair:
            metrics["num_cached_prompt_tokens"] = text.num_cached_prompt_tokens
            metrics["kv_fallback"] = state.local_prefill
        if state.silent:
            metrics["no_speech"] = True  # the answer had nothing to speak: text, no audio
        if audio is not None:
            assert audio_stage is not None, "found with the audio"
            # Streamed: when the first chunk was handed on; otherwise the audio came whole at the end.
            metrics["ttfa_ms"] = (
                state.audio_chunk_ms[0] if state.audio_chunk_ms else state.stage_spans[audio_stage][1]
            )
        metrics["timeline"] = {
            "stages": {
                str(k): {"name": self._stage_name(k), "start_ms": span[0], "end_ms": span[-1]}
                for k, span in state.stage_spans.items()
            },
            "audio_chunks_ms": list(state.audio_chunk_ms),
        }
        return OmniRequestOutput(
            request_id=state.request_id,
            prompt_token_ids=text.prompt_token_ids,
            token_ids=text.token_ids,
            text=text.text,
            finish_reason=text.finish_reason,
            audio=audio.audio if audio else None,
            sample_rate=audio.sample_rate if audio else None,
            metrics=metrics,
            stage_outputs=dict(state.outputs) if self.keep_stage_outputs else None,
        )


SILENT = object()  # a streamed group's stage that ended because the answer has nothing to speak


class _StreamedGroup:
    """One request's run of a streamed group of stages (`AsyncOmni._run_streamed`): what each
    stage of the group has been sent, and the callbacks that move chunks down the group. Lives
    only as long as that run."""

    def __init__(
        self,
        omni: AsyncOmni,
        state: RequestState,
        group: list[int],
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: Callable[[str], None] | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
    ) -> None:
        self.omni, self.state, self.group = omni, state, group
        self.text_prompt, self.deadline = text_prompt, deadline
        self.on_text, self.on_audio = on_text, on_audio
        loop = asyncio.get_running_loop()
        self.feeders = {sid: omni.stream_processors[sid](omni._stage_inputs(state, sid)) for sid in group[1:]}
        self.waiters: dict[int, Any] = {}  # stage -> its StageClient waiter, once submitted
        self.opened = {sid: loop.create_future() for sid in group[1:]}
        self.closed: set[int] = set()  # stages that have had their last input

    def consumer(self, sid: int) -> int | None:
        index = self.group.index(sid) + 1
        return self.group[index] if index < len(self.group) else None

    def chunk_sizes(self, sid: int) -> tuple[int, int] | None:
        """How the consumer of `sid` takes its input, when its stream processor says (the
        group's first stage feeds a talker, which takes every token at once)."""
        target = self.consumer(sid)
        return getattr(self.feeders[target], "source_chunk_sizes", None) if target is not None else None

    # ---- feeding the later stages ------------------------------------------------------------
    def pump(self, sid: int) -> None:
        """Move what stage `sid`'s stream processor holds to that stage (synchronously, so
        nothing sent for the request can overtake its submission)."""
        if sid not in self.waiters and not self._submit(sid):
            return
        if sid in self.closed:
            return
        data, final = self.feeders[sid].take()
        if data is None and not final:
            return  # nothing worth a message yet
        if final:
            self.closed.add(sid)
        self.omni._route(self.state, sid).append(self.state.request_id, data, final)

    def _submit(self, sid: int) -> bool:
        """Start stage `sid` on the request once its stream processor has an opening prompt;
        whether it has started."""
        prompt = self.feeders[sid].prompt()
        if prompt is None:
            return False
        state = self.state
        state.stage_started(sid)
        self.waiters[sid] = self.omni._route(state, sid).submit(
            state.request_id,
            prompt,
            state.params[sid],
            on_chunk=self.forward(sid),
            chunk_sizes=self.chunk_sizes(sid),
        )
        self.opened[sid].set_result(None)
        if prompt.final:
            self.closed.add(sid)
        return True

    def forward(self, sid: int) -> Callable[[Any], None]:
        """Stage `sid`'s chunk callback: into its consumer's stream processor, or, from the
        group's last stage, audio to the client."""
        target = self.consumer(sid)

        def on_chunk(chunk: Any) -> None:
            if target is not None:
                self.feeders[target].feed(chunk)
                self.pump(target)
            elif isinstance(chunk, AudioOutput):
                self._deliver_audio(chunk)

        return on_chunk

    def _deliver_audio(self, chunk: AudioOutput) -> None:
        state = self.state
        state.audio_chunk_ms.append(state.elapsed_ms())
        state.audio_pieces.append(chunk.audio)
        if self.on_audio is not None:
            self.on_audio(chunk.audio, chunk.sample_rate)

    def go_silent(self) -> None:
        """Nothing to speak: the later stages end without their input (none has started:
        a talker opens on a generated token that such an answer lacks; any that has is
        stopped)."""
        for later in self.group[1:]:
            if later in self.waiters:
                self.omni._route(self.state, later).abort(self.state.request_id)
            if not self.opened[later].done():
                self.opened[later].set_result(None)

    # ---- running each stage ------------------------------------------------------------------
    async def _run_first(self) -> Any:
        """The group's first stage, from its finished input; SILENT when the answer is."""
        sid = self.group[0]
        output = await self.omni._run_stage(
            self.state, sid, self.text_prompt, self.deadline, self.on_text, on_chunk=self.forward(sid)
        )
        if self.state.silent:
            self.go_silent()
            return SILENT
        return output

    async def _run_fed(self, sid: int) -> Any:
        """A later stage of the group: its result once its source has fed it all; SILENT when
        the answer turned out to be."""
        state = self.state
        await self.opened[sid]
        if state.silent:
            return SILENT
        began = time.perf_counter()
        try:
            output = await self.omni._route(state, sid).result(
                state.request_id, self.waiters[sid], self.deadline - time.monotonic()
            )
        except StageError:
            if state.silent:  # stopped by go_silent
                return SILENT
            raise
        if isinstance(output, AudioOutput) and output.samples_in_chunks:
            # The worker sent its samples as chunks only: the whole audio is their sum.
            pieces, state.audio_pieces = state.audio_pieces, []
            output = dataclasses.replace(
                output, samples_in_chunks=False, audio=(torch.cat(pieces) if pieces else output.audio)
            )
        state.stage_finished(sid, began, output)
        return output

    async def _run_one(self, sid: int) -> None:
        output = await (self._run_first() if sid == self.group[0] else self._run_fed(sid))
        if output is SILENT:
            return
        state = self.state
        if sid in state.replicas:  # no longer this replica's load
            state.replicas[sid].release()
        target = self.consumer(sid)
        if target is not None:  # the source is done: its consumer gets its last input
            self.feeders[target].close(output)
            self.pump(target)
        if self.omni.pd_pair and sid == self.omni.pd_pair.decode_stage_id:
            self.omni._release_kv(state)  # the decode leg has its copy; after the hand-on

    async def run(self) -> None:
        """Every stage of the group at once; the first failure stops the rest and is raised."""
        state, group = self.state, self.group
        tasks = {asyncio.create_task(self._run_one(sid)): sid for sid in group}
        state.active_stages.update(group)
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                await self._stop(tasks, pending)
                # The upstream-most failure is the cause; downstream ones follow from it.
                cause = min(failed, key=lambda t: group.index(tasks[t])).exception()
                assert cause is not None, "failed holds the tasks that raised"
                raise cause
        finally:
            state.active_stages.difference_update(group)
            for task in tasks:
                if not task.done():
                    task.cancel()

    async def _stop(self, tasks: dict[asyncio.Task, int], pending: set[asyncio.Task]) -> None:
        for task in pending:  # stop the rest of the group at their next step
            self.omni._route(self.state, tasks[task]).abort(self.state.request_id)
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in pending:
            if not task.cancelled():
                task.exception()  # retrieved: they fail because we aborted them
