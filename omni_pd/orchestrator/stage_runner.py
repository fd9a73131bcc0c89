"""A request's call on one stage (or on a streamed group of stages): its input built from the
stages before it, its params (a P/D leg's included), its replica, its deadline, and its text
streamed back as it is generated. The P/D legs (pd_handoff.py) run through it too."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import torch

from .. import registry
from ..config.schema import StageConfig
from ..engines.base import StageInputs
from ..engines.types import TokenPrompt
from ..planning.pd import HandoffPolicy, PDPair
from ..sampling import SamplingParams
from .breaker import CircuitBreaker
from .detokenizer import IncrementalDetokenizer
from .pd_handoff import PDHandoff
from .request_io import RequestTimeout, TextSink
from .request_state import RequestState
from .routing import Router
from .streamed_group import StreamedGroup

log = logging.getLogger(__name__)


class StageRunner:
    """Runs a request's stages for `AsyncOmni`, and owns the P/D pair's legs (`pd`), which run
    their stages through it."""

    def __init__(
        self,
        stages: Mapping[int, StageConfig],
        router: Router,
        pipeline: registry.ModelPipeline,
        text_stage_id: int,
        processors: dict[int, Any],
        stream_processors: dict[int, Any],
        request_timeout_s: float,
        pair: PDPair | None,
        policy: HandoffPolicy | None,
        breakers: dict[tuple[int, int], CircuitBreaker],
    ) -> None:
        """`pair`, `policy`, `breakers`: the P/D pair's (startup.plan_handoff), for its legs."""
        self.stages, self.router, self.pipeline = stages, router, pipeline
        self.text_stage_id = text_stage_id
        self.processors, self.stream_processors = processors, stream_processors
        self.request_timeout_s = request_timeout_s
        self.pd = PDHandoff(pair, policy, breakers, router, self)

    async def run_stage(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any:
        began = time.perf_counter()
        state.active_stages.add(stage_id)
        state.stage_started(stage_id)
        try:
            output = await self.stage_call(state, stage_id, text_prompt, deadline, on_text, on_chunk)
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

    async def run_streamed(
        self,
        state: RequestState,
        group: list[int],
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
    ) -> None:
        """Run a group of stages at once. The first starts from its finished input; each later
        one is fed its source's chunks through its stream processor, starts as soon as that has
        an opening prompt, and gets the rest of its input as it comes."""
        feeders = {sid: self.stream_processors[sid](self.stage_inputs(state, sid)) for sid in group[1:]}
        await StreamedGroup(
            self, self.router, self.pd, state, group, feeders, text_prompt, deadline, on_text, on_audio
        ).run()

    def stage_inputs(self, state: RequestState, stage_id: int) -> StageInputs:
        stage = self.stages[stage_id]
        return StageInputs(
            request_id=state.request_id,
            stage_id=stage_id,
            source_stage_ids=tuple(stage.engine_input_source),
            # live: a stream processor made before a P/D fallback sees the
            # prefill leg's output go
            upstream=state.outputs,
            model_config=self.pipeline.config,
            speaker=state.prompt.speaker,
            engine_args=stage.engine_args,
        )

    async def stage_call(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any:
        stage = self.stages[stage_id]
        params = state.params[stage_id]
        prompt: Any = text_prompt
        pair = self.pd.pair
        if pair and stage_id == pair.prefill_stage_id:
            params = self.pd.prefill_params(state, params)
        elif pair and stage_id == pair.decode_stage_id and not state.local_prefill:
            return await self.pd.remote_decode(state, text_prompt, deadline, on_text, on_chunk)
        elif pair and stage_id == pair.decode_stage_id:
            pass  # the fallback: the decode engine computes the whole prompt, as colocated
        elif stage.engine_input_source:
            prompt = self.processors[stage_id](self.stage_inputs(state, stage_id))
        on_tokens = None
        if on_text is not None and stage_id == self.text_stage_id:
            on_tokens = self.text_stream(state, params, on_text)
        remaining = self.time_left(state, deadline, stage_id)
        text_leg = stage_id == self.text_stage_id or (pair is not None and stage_id == pair.prefill_stage_id)
        return await self.generate(
            state,
            stage_id,
            prompt,
            params,
            remaining,
            on_tokens,
            on_chunk,
            rows=state.text_rows or not text_leg,
        )

    async def generate(
        self,
        state: RequestState,
        stage_id: int,
        prompt: Any,
        params: SamplingParams,
        remaining: float,
        on_tokens: Callable[[list[int]], None] | None,
        on_chunk: Callable[[Any], None] | None,
        rows: bool,
    ) -> Any:
        """The request on its replica of `stage_id`, its hops stamped: sent, its first tokens
        back, its result back."""
        client = self.router.route(state, stage_id)
        where = client.name
        if on_tokens is not None:
            stream = on_tokens

            def on_tokens(token_ids: list[int]) -> None:
                state.hop(where, "tokens in")
                stream(token_ids)

        state.hop(where, "sent")
        output = await client.generate(
            state.request_id, prompt, params, remaining, on_tokens, on_chunk, rows=rows
        )
        state.hop(where, "result in")
        return output

    def time_left(self, state: RequestState, deadline: float, stage_id: int) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout(
                f"request {state.request_id} passed its {self.request_timeout_s:.0f} s "
                f"deadline before stage {stage_id}"
            )
        return remaining

    def text_stream(
        self, state: RequestState, params: SamplingParams, on_text: TextSink
    ) -> Callable[[list[int]], None]:
        """The token ids -> text deltas callback for a text stage's stream. One detokenizer per
        request: a stage that streams after the prefill leg's first token went out (the decode
        leg, or its fallback) skips the tokens already streamed."""
        if state.text_stream is None:
            detok = IncrementalDetokenizer(self.pipeline.tokenizer, params, self.pipeline.eos_token_ids)

            def stream(token_ids: list[int]) -> None:  # on the event loop
                # Every step with new tokens sends, as vLLM does: "" while the text is held
                # back, so a client times the first token when it exists.
                on_text(detok.add(token_ids), len(token_ids))
                state.hop("orchestrator", "text out")

            state.text_stream = stream
            return stream
        skip = state.tokens_streamed_early

        def on_tokens(token_ids: list[int]) -> None:
            nonlocal skip
            dropped, skip = min(skip, len(token_ids)), max(skip - len(token_ids), 0)
            if len(token_ids) > dropped:
                state.text_stream(token_ids[dropped:])

        return on_tokens
