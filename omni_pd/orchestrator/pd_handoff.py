"""The orchestrator's side of a P/D pair: the prefill leg within its miss window, the decode leg
with the prefill leg's KV, push reservations, the KV lease's early release, each link's breaker,
and the fallback (`kv_fallback`) a request gets when it cannot use the prefill side: the decode
engine computes the prompt itself (`local_prefill`, output identical to colocated) or a named
error."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Protocol

from ..engines.types import TokenPrompt
from ..kv.push import TARGET_KEY
from ..planning import build_decode_sampling_params, build_prefill_sampling_params, new_transfer_id
from ..planning.pd import HandoffPolicy, PDPair
from ..sampling import SamplingParams
from .breaker import CircuitBreaker
from .request_io import HandoffFailed, RequestAborted, TextSink
from .request_state import RequestState
from .routing import Router
from .stage_client import StageClient, StageError, StageTimeout

log = logging.getLogger(__name__)
RELEASE_KV_TIMEOUT_S = 2.0  # an unreleased lease expires on its own (kv_lease_timeout_s)
# How a worker names a failed KV handoff (the exception class in front of its message).
HANDOFF_FAILURES = frozenset(
    {"KVTransferError", "KVMissError", "KVIntegrityError", "KVIncompatibleError", "KVTransferFailed"}
)


class StageCalls(Protocol):
    """What the P/D legs run through (stage_runner.StageRunner): a stage's call on a request."""

    async def run_stage(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any: ...

    async def stage_call(
        self,
        state: RequestState,
        stage_id: int,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_chunk: Callable[[Any], None] | None = None,
    ) -> Any: ...

    def text_stream(
        self, state: RequestState, params: SamplingParams, on_text: TextSink
    ) -> Callable[[list[int]], None]: ...

    def time_left(self, state: RequestState, deadline: float, stage_id: int) -> float: ...

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
    ) -> Any: ...


class PDHandoff:
    """The P/D pair's legs and their state: each link's breaker, the failed handoffs and
    fallbacks counted, and the KV releases nobody waits for. Without a pair it holds nothing and
    its releases do nothing (a request never gets a transfer id)."""

    def __init__(
        self,
        pair: PDPair | None,
        policy: HandoffPolicy | None,
        breakers: dict[tuple[int, int], CircuitBreaker],
        router: Router,
        runner: StageCalls,
    ) -> None:
        self.pair, self.policy, self.breakers = pair, policy, breakers
        self.router, self.runner = router, runner
        self.handoff_failures = self.fallbacks = 0
        self.background: set[asyncio.Task] = set()  # KV releases nobody waits for
        self._warned_incompatible = False

    @property
    def _pair(self) -> PDPair:
        """The P/D pair, for the code that runs only in a pipeline that has one (the handoff's)."""
        assert self.pair is not None, "this pipeline has no P/D pair"
        return self.pair

    @property
    def _policy(self) -> HandoffPolicy:
        assert self.policy is not None, "a pipeline with a P/D pair has its handoff policy"
        return self.policy

    @property
    def _closed(self) -> bool:
        return not self.router.pools

    # ---- the prefill leg -------------------------------------------------------------------
    async def prefill_leg(
        self,
        state: RequestState,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None = None,
    ) -> None:
        """Run the prefill leg within the miss window, or decide that the decode leg computes the
        prompt itself (the breaker is open, the prefill worker is down or silent, or the leg
        failed); with kv_fallback 'error' that decision is a HandoffFailed instead. A streamed
        request's first token leaves as soon as the prefill leg has it: the KV handoff is not on
        its time to first token (the decode leg's stream starts with the same token, skipped)."""
        pair, policy = self._pair, self._policy
        client = self._pick_prefill_replica(state)
        if client is None:
            return
        now = time.monotonic()
        state.handoff_deadline = min(now + policy.deadline_s, deadline)
        if policy.transfer_mode == "push":
            await self._reserve_push(
                state, text_prompt, min(now + policy.miss_window_s, state.handoff_deadline)
            )
        try:
            await self.runner.run_stage(
                state,
                pair.prefill_stage_id,
                text_prompt,
                min(now + policy.miss_window_s, state.handoff_deadline),
                None,
            )
        except StageError as exc:
            if state.aborted:
                raise RequestAborted(f"request {state.request_id} was aborted") from None
            self.handoff_failed(
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
            self.runner.text_stream(state, state.params[pair.decode_stage_id], on_text)(first)
            state.tokens_streamed_early = len(first)

    def _pick_prefill_replica(self, state: RequestState) -> StageClient | None:
        """The decode replica first: the prefill replica is the best one whose link to it is up.
        None (the request falls back, or HandoffFailed) when there is none."""
        pair = self._pair
        self.router.route(state, pair.decode_stage_id)
        decode = state.replicas[pair.decode_stage_id].index
        pool = self.router.pools[pair.prefill_stage_id]
        tokens, positions = self.router.footprint(state, pair.prefill_stage_id)
        ranked = pool.ranked(tokens, positions)
        if not ranked:
            self._no_remote(state, str(pool.unavailable()))
            return None
        chosen = next((p for p in ranked if self.breakers[(p, decode)].allow()), None)
        if chosen is None:
            breaker = self.breakers[(ranked[0], decode)]
            self._no_remote(
                state,
                f"the {breaker.name} breaker is {breaker.state.value} "
                f"after {breaker.consecutive_failures} failed handoffs",
            )
            return None
        state.replicas[pair.prefill_stage_id] = pool.assign(chosen, tokens)
        self.router.log_route(state, pair.prefill_stage_id)
        return pool.clients[chosen]

    def prefill_params(self, state: RequestState, params: SamplingParams) -> SamplingParams:
        """The prefill leg's params: stop conditions neutralised, the KV published under the
        request's transfer id (and written into the decode replica's reservation in push mode)."""
        if state.push_target is None:  # a push reservation named the transfer already
            state.transfer_id = new_transfer_id(state.request_id)
        assert state.transfer_id is not None, "set by the push reservation or just above"
        params = build_prefill_sampling_params(params, state.transfer_id)
        if state.push_target is not None:
            params = params.replace(
                kv_transfer_params={**(params.kv_transfer_params or {}), TARGET_KEY: state.push_target}
            )
        return params

    # ---- push reservations -----------------------------------------------------------------
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
            self.release_push(state)

    def release_push(self, state: RequestState, writer_gone: bool = False) -> None:
        """Push mode: give the decode replica's reservation up (the prefill leg failed, or the
        request left before its decode leg took it). Sent now, answered in the background."""
        if state.push_target is None or self._closed:
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
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @staticmethod
    async def _await_control(client: StageClient, future, name: str, state: RequestState) -> None:
        try:
            await client.await_call(future, name, RELEASE_KV_TIMEOUT_S)
        except StageError as exc:
            log.debug("request %s: %s not answered (%s)", state.request_id, name, exc)

    # ---- failures and the fallback ---------------------------------------------------------
    def handoff_failed(self, state: RequestState, why: str) -> None:
        self.handoff_failures += 1
        self.link_breaker(state).failure(why)
        self.release_kv(state)
        self.release_push(state, writer_gone=self._prefill_gone(state))
        state.outputs.pop(self._pair.prefill_stage_id, None)
        state.stage_spans.pop(self._pair.prefill_stage_id, None)
        self._no_remote(state, why)

    def _prefill_gone(self, state: RequestState) -> bool:
        """Whether the request's prefill worker is down (it cannot write a late push)."""
        assignment = state.replicas.get(self._pair.prefill_stage_id)
        return assignment is not None and assignment.client.unavailable() is not None

    def _no_remote(self, state: RequestState, why: str) -> None:
        if self._policy.fallback == "error":
            raise HandoffFailed(
                f"request {state.request_id}: the KV handoff from "
                f"{self._prefill_name(state)} is not "
                f"possible ({why}); kv_fallback is 'error' (set kv_fallback: "
                "local_prefill to let the decode engine compute such prompts)",
                self._policy.breaker_cooldown_s,
            )
        self.fallbacks += 1
        state.local_prefill = True
        log.debug("request %s: the decode engine computes the prompt itself (%s)", state.request_id, why)

    def link_breaker(self, state: RequestState) -> CircuitBreaker:
        pair = self._pair
        return self.breakers[
            (state.replicas[pair.prefill_stage_id].index, state.replicas[pair.decode_stage_id].index)
        ]

    def _prefill_name(self, state: RequestState) -> str:
        assignment = state.replicas.get(self._pair.prefill_stage_id)
        return (
            assignment.client
            if assignment is not None
            else self.router.pools[self._pair.prefill_stage_id].first
        ).name

    # ---- the decode leg --------------------------------------------------------------------
    async def remote_decode(
        self,
        state: RequestState,
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_chunk: Callable[[Any], None] | None,
    ) -> Any:
        """The decode leg with the prefill leg's KV. A failed handoff (a KV read that missed its
        window, a corrupted block, an incompatible peer) fails before the leg produces anything,
        so the request is run again on the fallback path."""
        decode_id = self._pair.decode_stage_id
        params = self._decode_params(state, deadline)
        # The KV covers the prompt (audio included): the decode leg needs only the token ids.
        prompt = text_prompt.tokens_only()
        on_tokens = self.runner.text_stream(state, params, on_text) if on_text is not None else None
        remaining = self.runner.time_left(state, deadline, decode_id)
        state.push_target = None  # the decode leg takes (or frees) its reservation now
        try:
            output = await self.runner.generate(
                state, decode_id, prompt, params, remaining, on_tokens, on_chunk, rows=state.text_rows
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
                    self._policy.fallback,
                )
            self.handoff_failed(state, str(exc))
            return await self.runner.stage_call(state, decode_id, text_prompt, deadline, on_text, on_chunk)
        self.link_breaker(state).success()
        return output

    def _decode_params(self, state: RequestState, deadline: float) -> SamplingParams:
        """The decode leg's params: where the prefill leg's KV is, and how long to wait for it."""
        pair = self._pair
        prefill_out = state.outputs[pair.prefill_stage_id]
        assert state.transfer_id is not None, "the prefill leg set the transfer id"
        params = build_decode_sampling_params(
            state.params[pair.decode_stage_id], prefill_out.kv_transfer_params or {}, state.transfer_id
        )
        assert params.kv_transfer_params is not None, "build_decode_sampling_params sets them"
        wait_s = min(
            self._policy.miss_window_s,
            state.handoff_deadline - time.monotonic(),
            deadline - time.monotonic(),
        )
        return params.replace(kv_transfer_params={**params.kv_transfer_params, "kv_wait_s": max(wait_s, 0.0)})

    # ---- the KV lease ----------------------------------------------------------------------
    def release_kv(self, state: RequestState) -> None:
        """Tell the prefill leg it may free the request's KV blocks now rather than at lease
        expiry. Sent at once (so a later state query sees it), answered in the background: the
        request's answer never waits on it."""
        if state.transfer_id is None or state.kv_released or self._closed:
            return
        state.kv_released = True
        client = state.replicas[self._pair.prefill_stage_id].client
        try:
            future = client.control_future("release_kv", transfer_id=state.transfer_id)
        except StageError as exc:  # restarting or down: its leases went with the old worker
            log.debug("request %s: KV lease %s not released (%s)", state.request_id, state.transfer_id, exc)
            return
        task = asyncio.ensure_future(self._await_release(client, future, state))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @staticmethod
    async def _await_release(client: StageClient, future, state: RequestState) -> None:
        try:
            await client.await_call(future, "release_kv", RELEASE_KV_TIMEOUT_S)
        except StageError as exc:  # a timeout included: an unreleased lease expires on its own
            log.debug("request %s: KV lease %s not released (%s)", state.request_id, state.transfer_id, exc)

    def cancel_background(self) -> None:
        for task in list(self.background):
            task.cancel()
