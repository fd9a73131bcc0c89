"""The one interface every stage engine offers its worker, and what a stage input processor
receives.

An engine is a step loop, not a request handler (vLLM v1's EngineCore is the shape): requests are
added and aborted at any time, and each `step()` runs one scheduling round (one forward pass per
model for the requests it picked) and returns per-request outputs: streamed token deltas, and
one final record (or error) per finished request. The worker calls `step()` while
`has_unfinished_requests()`; nothing else drives the engine.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import Any, Sequence

from .. import faults
from ..config.cpus import format_cpulist
from ..sampling import SamplingParams


@dataclass
class StageInputs:
    """What a `custom_process_input_func` gets to build a stage's prompt."""

    request_id: str
    stage_id: int
    source_stage_ids: tuple[int, ...]
    # Outputs of every stage that has finished for this request, by stage id: a P/D merge needs
    # the prefill leg's output even though only the decode leg feeds the next stage.
    upstream: dict[int, Any]
    model_config: Any  # the model's top-level (HF) config
    speaker: str = "ethan"
    engine_args: Any = None  # the stage's engine_args (chunk sizes a stream processor may honour)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)  # text tokens, for streamed requests
    # What a streamed request produced this step for the next stage or the client (the talker's
    # new codec frames, code2wav's new samples); its final `output` still holds the whole result.
    chunk: Any = None
    finished: bool = False
    output: Any = None  # the stage's output record, when finished without error
    error: str | None = None  # set when the request failed (finished is then True)

    @classmethod
    def failed(cls, request_id: str, error: str) -> "StepOutput":
        return cls(request_id, finished=True, error=error)


@dataclass
class BatchStats:
    """How an engine has batched: the evidence that requests really share forward passes."""

    steps: int = 0
    decode_steps: int = 0
    max_decode_batch: int = 0  # most requests advanced by one decode pass
    max_admitted: int = 0  # most requests started in one step
    decode_rows: int = 0  # requests advanced, summed over decode steps (mean batch: / decode_steps)
    max_step_tokens: int = 0  # most tokens one step computed (decodes + prompt positions)
    partial_chunks: int = 0  # prompt chunks that were not a prompt's last (chunked prefill)

    def record(self, admitted: int, decoding: int, tokens: int = 0, partial_chunks: int = 0) -> None:
        self.steps += 1
        self.max_admitted = max(self.max_admitted, admitted)
        self.max_step_tokens = max(self.max_step_tokens, tokens)
        self.partial_chunks += partial_chunks
        if decoding:
            self.decode_steps += 1
            self.decode_rows += decoding
            self.max_decode_batch = max(self.max_decode_batch, decoding)


class StageEngine(ABC):
    """Serves many requests at once through `add_request` / `abort_request` / `step`."""

    stage_id: int
    # Where the engine computes: the worker moves each request's input tensors there (they
    # arrive as host values) before the engine sees them.
    device: str = "cpu"

    @abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        stream: bool = False,
        chunks: bool = False,
        chunk_sizes: tuple[int, int] | None = None,
        rows: bool = True,
    ) -> None:
        """Queue a request built for this stage. Raises ValueError, with a message naming what to
        change, for a request this engine can never run. `stream` asks for token deltas (a text
        stage) or chunks (a stage whose only streamed output is chunks); `chunks` asks a text
        stage for its chunks too (a downstream stage is fed while it runs). `chunk_sizes`
        (first, later): the output units a chunk should gather before it leaves, because the
        downstream stage takes them that way (the talker's frames, in code2wav's chunks); an
        engine whose chunks are one token each (a thinker feeding a talker) has none to gather.
        `rows` False: no later stage reads the request's per-token rows (a text-only request),
        so the engine need not record them and its output carries none."""

    def append_input(self, request_id: str, data: Any, final: bool) -> None:
        """More input for a request whose prompt said more would follow (streaming between
        stages); `final` marks the last piece. Engines that take streamed input override this."""
        raise ValueError(f"stage {self.stage_id} does not take streamed input")

    @abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Forget a request and free what it holds; no output follows. Unknown ids are ignored."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work (waiting or running requests)."""

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """One scheduling round. A failure confined to one request is reported as that request's
        `StepOutput.failed`; an exception raised here fails every request the engine holds."""

    def request_ids(self) -> list[str]:
        """Every request the engine holds (waiting or running)."""
        return []

    def step_delay_s(self) -> float:
        """How long the worker may wait for messages before the next step: above 0 when every
        request waits on I/O (a KV read), so the loop does not spin a core meanwhile."""
        return 0.0

    def wake_fd(self) -> int | None:
        """A non-blocking eventfd the engine signals when I/O its requests wait on ends (a KV
        receive), so a worker waits on it instead of polling; None: it polls (step_delay_s)."""
        return None

    def wait_for_io(self, timeout_s: float, conns: Sequence[Any] = ()) -> list[Any]:
        """Wait up to `timeout_s` for a message on one of `conns` (multiprocessing connections)
        or for the engine's I/O to end (its wake fd, reset here): the conns with a message."""
        waker = self.wake_fd()
        if waker is None and not conns:
            time.sleep(timeout_s)  # nothing to wait on but the clock
            return []
        ready = wait_any([*conns, *([waker] if waker is not None else [])], timeout_s)
        if waker is not None and waker in ready:
            try:
                os.eventfd_read(waker)
            except BlockingIOError:  # reset by another reader in between
                pass
        return [c for c in ready if c is not waker]

    # Engine calls the orchestrator may make outside the request path, by name.
    control_calls: frozenset[str] = frozenset(
        {"debug_state_counts", "runtime_info", "batch_stats", "arm_fault"}
    )

    def close(self) -> None:
        """Release what the engine holds (models, registered memory, sockets)."""

    def describe(self) -> dict[str, Any]:
        """Facts the orchestrator logs and routes on (engine id, KV session, ...;
        `takes_multimodal_prompts`: False refuses prompts with audio or images up front)."""
        return {}

    def housekeeping(self) -> None:
        """Periodic work (expire KV leases); the worker calls it between steps."""

    def debug_state_counts(self) -> dict[str, int]:
        """Per-request state this engine holds; all zero when no request is in flight."""
        return {}

    def load(self) -> dict[str, int]:
        """How busy the engine is now, for the orchestrator's router: `requests` held, and where
        the engine has a KV cache, `free_kv_blocks` of `kv_blocks` (and `kv_block_size`)."""
        return {"requests": len(self.request_ids())}

    def batch_stats(self) -> dict[str, int]:
        """How the engine has batched so far (steps, largest batch), for operators and tests."""
        return {}

    def runtime_info(self) -> dict[str, Any]:
        """What the worker process runs with (threads, and the CPUs this thread may run on as a
        cpulist), for operators and tests."""
        import torch

        return {
            "num_threads": torch.get_num_threads(),
            "num_interop_threads": torch.get_num_interop_threads(),
            "cpus": format_cpulist(os.sched_getaffinity(0)),
        }

    def arm_fault(self, fault: str, **params: Any) -> None:
        """Tests only: arm the named fault (omni_pd/faults.py) in this engine's process."""
        faults.arm_fault(fault, **params)

    def control(self, name: str, **kwargs: Any) -> Any:
        if name not in self.control_calls:
            raise ValueError(
                f"stage {self.stage_id} has no control call {name!r}; it offers {sorted(self.control_calls)}"
            )
        return getattr(self, name)(**kwargs)

    def generate(self, request_id: str, prompt: Any, params: SamplingParams) -> Any:
        """Run one request to completion on an otherwise idle engine (tests and tools; the
        worker uses add_request / step)."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"stage {self.stage_id}: generate() needs an idle engine")
        self.add_request(request_id, prompt, params)
        while True:
            for out in self.step():
                if out.request_id == request_id and out.finished:
                    if out.error is not None:
                        raise RuntimeError(out.error)
                    return out.output
            if not self.has_unfinished_requests():
                raise RuntimeError(f"stage {self.stage_id}: request {request_id} vanished")
