"""One request's run of a streamed group of stages: consecutive stages joined by streamed edges
run at once, each later one fed its source's chunks through its stream processor."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable

import torch

from ..engines.types import AudioOutput, TokenPrompt
from .pd_handoff import PDHandoff, StageCalls
from .request_state import RequestState
from .routing import Router
from .stage_client import StageError
from .request_io import TextSink

SILENT = object()  # a streamed group's stage that ended because the answer has nothing to speak


class StreamedGroup:
    """One request's run of a streamed group of stages (`StageRunner.run_streamed`): what each
    stage of the group has been sent, and the callbacks that move chunks down the group. Lives
    only as long as that run. `feeders`: the stream processor of each stage but the first."""

    def __init__(
        self,
        runner: StageCalls,
        router: Router,
        pd: PDHandoff,
        state: RequestState,
        group: list[int],
        feeders: dict[int, Any],
        text_prompt: TokenPrompt,
        deadline: float,
        on_text: TextSink | None,
        on_audio: Callable[[torch.Tensor, int], None] | None,
    ) -> None:
        self.runner, self.router, self.pd = runner, router, pd
        self.state, self.group, self.feeders = state, group, feeders
        self.text_prompt, self.deadline = text_prompt, deadline
        self.on_text, self.on_audio = on_text, on_audio
        loop = asyncio.get_running_loop()
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
        self.router.route(self.state, sid).append(self.state.request_id, data, final)

    def _submit(self, sid: int) -> bool:
        """Start stage `sid` on the request once its stream processor has an opening prompt;
        whether it has started."""
        prompt = self.feeders[sid].prompt()
        if prompt is None:
            return False
        state = self.state
        state.stage_started(sid)
        client = self.router.route(state, sid)
        state.hop(client.name, "sent")
        self.waiters[sid] = client.submit(
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
                self.router.route(self.state, later).abort(self.state.request_id)
            if not self.opened[later].done():
                self.opened[later].set_result(None)

    # ---- running each stage ------------------------------------------------------------------
    async def _run_first(self) -> Any:
        """The group's first stage, from its finished input; SILENT when the answer is."""
        sid = self.group[0]
        output = await self.runner.run_stage(
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
            output = await self.router.route(state, sid).result(
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
        if self.pd.pair and sid == self.pd.pair.decode_stage_id:
            self.pd.release_kv(state)  # the decode leg has its copy; after the hand-on

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
            self.router.route(self.state, tasks[task]).abort(self.state.request_id)
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in pending:
            if not task.cancelled():
                task.exception()  # retrieved: they fail because we aborted them
