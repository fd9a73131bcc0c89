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

`AsyncOmni` holds a request's walk from prompt to output and the public API; the parts it owns
do one job each: start-up and the workers (startup.py), routing (routing.py), a stage's call
(stage_runner.py), the P/D legs (pd_handoff.py), a streamed group (streamed_group.py), health
(health.py). The request's records and errors are in request_io.py, exported here too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence, cast

import torch

from .. import hops, registry
from ..engines.types import AudioOutput, TextOutput, TokenPrompt
from ..planning import expand_sampling_params, find_pd_pair
from ..planning.pd import HandoffPolicy, PDPair
from ..sampling import SamplingParams
from .breaker import CircuitBreaker
from .graph import topological_order
from .health import debug_state_counts, health_report
from .outputs import OmniRequestOutput
from .pd_handoff import PDHandoff
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
    TextSink,
)
from .request_state import RequestState
from .routing import Router, stages_for, streamed_groups
from .stage_client import StageClient, StageError
from .stage_runner import StageRunner
from .worker_start import start_server_early, stop_early_server
from .startup import Workers, load_config, load_processors, note_unused_engine_keys, plan_handoff

__all__ = [
    "AsyncOmni",
    "AudioDelta",
    "Finished",
    "HandoffFailed",
    "PreparedPrompt",
    "PromptTooLong",
    "RequestAborted",
    "RequestTimeout",
    "TextDelta",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
]

log = logging.getLogger(__name__)
DEFAULT_REQUEST_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
MODALITIES = frozenset({"text", "audio"})


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
        self.stage_configs_path, self.config = load_config(stage_configs_path, deploy_config, device, model)
        server = None
        if any(
            s.runtime.process and s.engine_args.distributed_executor_backend != "ray"
            for s in self.config.stages
        ):
            server = start_server_early()  # its imports run while this process loads the model's side
        try:
            self._start(model, keep_stage_outputs, request_timeout_s, startup_timeout_s)
        except BaseException:
            if server is not None:
                stop_early_server(server)
            raise

    def _start(
        self, model: str, keep_stage_outputs: bool, request_timeout_s: float, startup_timeout_s: float
    ) -> None:
        self.keep_stage_outputs = keep_stage_outputs
        self.stages = {s.stage_id: s for s in self.config.stages}
        self.order = topological_order({s.stage_id: tuple(s.engine_input_source) for s in self.config.stages})
        self.pd_pair: PDPair | None = find_pd_pair(self.config)
        handoff, breakers = plan_handoff(self.pd_pair, self.stages)
        note_unused_engine_keys(self.config)
        self._load_pipeline(model)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.workers = Workers()
        self.router = Router(self.stages, self.workers.pools, self.pipeline.text_model_stage)
        self.runner = StageRunner(
            self.stages,
            self.router,
            self.pipeline,
            self.text_stage_id,
            self.processors,
            self.stream_processors,
            request_timeout_s,
            self.pd_pair,
            handoff,
            breakers,
        )
        self.pd: PDHandoff = self.runner.pd
        self.workers.set_orchestrator_threads(self.config)
        self.workers.start(self.config, self.stages, self.order, model, startup_timeout_s)

    def _load_pipeline(self, model: str) -> None:
        """The model's side in this process: its tokenizer, context and stage input processors."""
        self.pipeline: registry.ModelPipeline = registry.load_pipeline(model)
        self.text_stage_id = self._final_stage("text")
        self.model_config = self.pipeline.config
        self.tokenizer = self.pipeline.tokenizer
        self.max_model_len = (
            self.stages[self.text_stage_id].engine_args.max_model_len or self.pipeline.context_len
        )
        self.processors, self.stream_processors = load_processors(self.config)

    def _final_stage(self, kind: str) -> int:
        finals = [s.stage_id for s in self.config.stages if s.final_output and s.final_output_type == kind]
        if finals:
            return finals[-1]
        text_stage = self.pipeline.text_model_stage
        return [s.stage_id for s in self.config.stages if s.model_stage == text_stage][-1]

    # The runner and the P/D legs hold these; set here, they change there (tests tighten them).
    @property
    def request_timeout_s(self) -> float:
        return self.runner.request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, value: float) -> None:
        self.runner.request_timeout_s = value

    @property
    def handoff(self) -> HandoffPolicy | None:
        """The P/D pair's handoff policy (None without a pair)."""
        return self.pd.policy

    @handoff.setter
    def handoff(self, policy: HandoffPolicy | None) -> None:
        self.pd.policy = policy

    @property
    def pools(self) -> dict[int, StagePool]:
        return self.workers.pools

    @property
    def clients(self) -> dict[int, StageClient]:
        """Each stage's first replica (its only one, unless num_replicas says otherwise)."""
        return {stage_id: pool.first for stage_id, pool in self.pools.items()}

    @property
    def breakers(self) -> dict[tuple[int, int], CircuitBreaker]:
        """One breaker per P/D link (prefill replica, decode replica)."""
        return self.pd.breakers

    @property
    def breaker(self) -> CircuitBreaker | None:
        """The first P/D link's breaker (1P1D: the pair's only one)."""
        return self.breakers.get((0, 0))

    @property
    def handoff_failures(self) -> int:
        return self.pd.handoff_failures

    @property
    def fallbacks(self) -> int:
        return self.pd.fallbacks

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self.pd.cancel_background()
        self.workers.close()

    @property
    def closed(self) -> bool:
        return not self.pools

    @property
    def worker_pids(self) -> list[int]:
        return [c.process.pid for c in self.workers.all_clients() if c.process is not None]

    async def control(
        self, stage_id: int, name: str, timeout_s: float = 30.0, replica: int = 0, **kwargs: Any
    ) -> Any:
        return await self.pools[stage_id].clients[replica].control_async(name, timeout_s, **kwargs)

    async def debug_state_counts(self) -> dict[str, int]:
        """Per-request state on every side (health.debug_state_counts)."""
        return await debug_state_counts(len(self._requests), self.pools)

    def health(self) -> dict[str, Any]:
        """Each stage's status and each replica's, and the P/D links' (health.health_report);
        "ok" when every worker is up and answering."""
        return health_report(
            self.pools, self._stage_name, self.breakers, self.handoff_failures, self.fallbacks
        )

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
        on_text: TextSink | None = None,
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
            text_rows="audio" in wanted,  # stages_for: text alone walks no stage after it
        )
        if state.request_id in self._requests:
            raise ValueError(f"request id {state.request_id} is already in flight")
        self._requests[state.request_id] = state
        try:
            return await self._run(
                state,
                stages_for(wanted, self.order, self.stages, self.text_stage_id),
                on_text,
                on_audio,
                prepared.text_prompt if prepared else None,
            )
        finally:
            self.pd.release_kv(state)  # sent now, its answer awaited in the background
            self.pd.release_push(state)
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
                on_text=lambda text, tokens: queue.put_nowait(TextDelta(text, tokens)),
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

    async def _run(
        self,
        state: RequestState,
        stage_ids: list[int],
        on_text: TextSink | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
        text_prompt: TokenPrompt | None = None,
    ) -> OmniRequestOutput:
        deadline = time.monotonic() + self.request_timeout_s
        if text_prompt is None:
            # Tokenizing (and extracting audio features) is CPU work: off the event loop, which
            # serves every other request meanwhile.
            # build_prompt gives a TokenPrompt; the registry types it Any, as it imports no layer above it.
            text_prompt = cast(TokenPrompt, await asyncio.to_thread(self.pipeline.build_prompt, state.prompt))
            state.hop("orchestrator", "prompt built")
        self._check_multimodal(text_prompt)
        prompt_len = state.prompt_len = len(text_prompt.prompt_token_ids)
        max_tokens = state.params[self.text_stage_id].max_tokens
        if prompt_len + max_tokens > self.max_model_len:
            raise PromptTooLong.of(prompt_len, max_tokens, self.max_model_len)
        for group in streamed_groups(stage_ids, self.stages, self.stream_processors):
            if state.aborted:
                raise RequestAborted(f"request {state.request_id} was aborted")
            if state.silent:
                break  # an answer with nothing to speak: the stages after the text stage skip it
            try:
                if self.pd_pair and group == [self.pd_pair.prefill_stage_id]:
                    await self.pd.prefill_leg(state, text_prompt, deadline, on_text)
                    continue
                for stage_id in group:  # restarting or silent stages: wait, within the deadline
                    await self.router.usable_replica(state, stage_id, deadline)
                if len(group) == 1:
                    await self.runner.run_stage(state, group[0], text_prompt, deadline, on_text)
                else:
                    await self.runner.run_streamed(state, group, text_prompt, deadline, on_text, on_audio)
            except StageError:
                if state.aborted:
                    raise RequestAborted(f"request {state.request_id} was aborted") from None
                raise
            if self.pd_pair and self.pd_pair.decode_stage_id in group:
                self.pd.release_kv(state)
        return self._finish(state)

    # ---- the P/D handoff ---------------------------------------------------------------------

    def _hops(self, state: RequestState) -> list[tuple[str, str, float]]:
        """The orchestrator's hop stamps and each stage worker's (from its output's metrics),
        except a Ray worker's: it may run on another node, on another clock."""
        found = [(where, hop, at) for (where, hop), at in state.hops.items()]
        found.append(("orchestrator", "arrived", state.started))
        for stage_id, output in state.outputs.items():
            metrics = getattr(output, "metrics", None)
            assignment = state.replicas.get(stage_id)
            if (
                not isinstance(metrics, dict)
                or assignment is None
                or self.stages[stage_id].engine_args.distributed_executor_backend == "ray"
            ):
                continue
            found.extend((assignment.client.name, hop, at) for hop, at in hops.stamps(metrics).items())
        return found

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
            # Where the request was when (hops.py): stamps since it arrived, by process.
            "origin": state.started,
            "hops": hops.timeline(state.started, self._hops(state)),
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
