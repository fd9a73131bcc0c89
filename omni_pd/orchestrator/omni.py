"""`Omni`: the offline, synchronous API over `AsyncOmni`.

It runs the AsyncOmni on an event loop in a private thread. A batch is submitted at once, so its
requests are batched together by every stage engine and overlap across stages."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from pathlib import Path
from typing import Any, Generator, Iterator, Sequence

import torch
from tqdm import tqdm

from ..sampling import SamplingParams
from .async_omni import (
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    AsyncOmni,
    AudioDelta,
    Finished,
    TextDelta,
)
from .outputs import OmniRequestOutput

_END = object()  # the last item a stream's queue gets


class Omni:
    """Offline multi-stage inference: `Omni(model=..., stage_configs_path=...).generate(prompts)`."""

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
        self.engine = AsyncOmni(
            model,
            stage_configs_path,
            deploy_config=deploy_config,
            keep_stage_outputs=keep_stage_outputs,
            request_timeout_s=request_timeout_s,
            startup_timeout_s=startup_timeout_s,
            device=device,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-pd-loop", daemon=True)
        self._thread.start()

    # What tests and callers read from the orchestrator.
    config = property(lambda self: self.engine.config)
    stages = property(lambda self: self.engine.stages)
    clients = property(lambda self: self.engine.clients)
    model_config = property(lambda self: self.engine.model_config)
    pipeline = property(lambda self: self.engine.pipeline)
    tokenizer = property(lambda self: self.engine.tokenizer)
    pd_pair = property(lambda self: self.engine.pd_pair)
    worker_pids = property(lambda self: self.engine.worker_pids)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def debug_state_counts(self) -> dict[str, int]:
        return self._call(self.engine.debug_state_counts())

    def health(self) -> dict[str, Any]:
        """Each stage's status and why (see `AsyncOmni.health`)."""
        return self.engine.health()

    def control(self, stage_id: int, name: str, **kwargs: Any) -> Any:
        """Call a stage engine's control function (tests and operators)."""
        return self._call(self.engine.control(stage_id, name, **kwargs))

    # ---- requests --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params_list: Sequence[SamplingParams | None] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[OmniRequestOutput]:
        if self.engine.closed:
            raise RuntimeError("this Omni is closed")
        batch = prompts if isinstance(prompts, (list, tuple)) and not _is_messages(prompts) else [prompts]
        futures = [
            asyncio.run_coroutine_threadsafe(self.engine.generate(p, sampling_params_list), self._loop)
            for p in batch
        ]
        try:
            with tqdm(
                total=len(batch), desc="omni-pd", unit="req", disable=not use_tqdm or len(batch) < 2
            ) as bar:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
                return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()  # only matters when one request failed and others still run

    def stream(
        self,
        prompt: Any,
        sampling_params_list: Sequence[SamplingParams | None] | None = None,
        *,
        modalities: Sequence[str] = ("text", "audio"),
    ) -> Generator[TextDelta | AudioDelta | Finished, None, None]:
        """`AsyncOmni.stream` for one prompt, synchronously: text and audio deltas as the stages
        produce them, then `Finished`. The request starts at the first `next()`; closing the
        generator early (break, `.close()`) aborts it."""
        if self.engine.closed:
            raise RuntimeError("this Omni is closed")
        events: queue.SimpleQueue = queue.SimpleQueue()

        async def pump() -> None:  # on the loop thread
            try:
                async for event in self.engine.stream(prompt, sampling_params_list, modalities=modalities):
                    events.put(event)
            except Exception as exc:  # noqa: BLE001 - raised again in the caller's thread
                events.put(exc)
            finally:
                events.put(_END)

        task = self._call(_start(pump()))
        try:
            while (item := events.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not self._loop.is_closed():
                self._call(_stop(task))  # returns once the request is aborted and forgotten

    def audio_chunks(
        self, prompt: Any, sampling_params_list: Sequence[SamplingParams | None] | None = None
    ) -> Iterator[torch.Tensor]:
        """Only the audio of `stream`: float32 mono chunks that concatenate to the waveform."""
        with contextlib.closing(self.stream(prompt, sampling_params_list)) as events:
            for event in events:
                if isinstance(event, AudioDelta):
                    yield event.audio


async def _start(coroutine) -> asyncio.Task:
    return asyncio.create_task(coroutine)


async def _stop(task: asyncio.Task) -> None:
    # Cancelling the pump closes AsyncOmni.stream, which aborts the request and waits for it.
    if not task.done():
        task.cancel()
        await asyncio.wait([task])


def _is_messages(value) -> bool:
    # A list of chat messages is one prompt, not a batch.
    return bool(value) and all(isinstance(v, dict) and "role" in v for v in value)
