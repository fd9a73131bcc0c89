"""Messages between the orchestrator and a stage worker.

Any number of requests are in flight on one worker: `AddRequest`, `AppendInput` and `Abort` may
arrive at any time, and the worker answers each request with `TokenDelta`s and `ChunkOutput`s
(when streamed) and then exactly one `GenerateResult` or `GenerateFailed`. Control calls are answered by `call_id`.

Sent as bytes pickled with the standard pickler: torch tensors are copied into the message rather
than shared through /dev/shm file descriptors (torch's multiprocessing reducers), so a dead peer
never leaves shared memory behind.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ..sampling import SamplingParams


@dataclass
class Ready:
    stage_id: int
    pid: int
    info: dict[str, Any]


@dataclass
class StartupFailed:
    stage_id: int
    message: str


@dataclass
class AddRequest:
    request_id: str
    prompt: Any
    params: SamplingParams
    stream: bool = False  # send TokenDelta / ChunkOutput messages while generating
    chunks: bool = False  # a text stage sends ChunkOutputs too (a downstream stage is fed by them)


@dataclass
class TokenDelta:
    """Tokens a text stage produced since its last delta for a streamed request."""

    request_id: str
    token_ids: list[int]


@dataclass
class AppendInput:
    """More input for a request whose prompt said more follows (a streamed upstream stage);
    `final` marks the last piece."""

    request_id: str
    data: Any
    final: bool


@dataclass
class ChunkOutput:
    """What a streamed request produced in one step (codec frames, audio samples)."""

    request_id: str
    data: Any


@dataclass
class Abort:
    """Stop working on a request (its client went away or its deadline passed). No answer
    follows; an Abort for a request the worker no longer holds is ignored."""

    request_id: str


@dataclass
class GenerateResult:
    request_id: str
    output: Any


@dataclass
class GenerateFailed:
    request_id: str
    message: str


@dataclass
class StepMessages:
    """Everything one engine step produced (token deltas, results, failures), sent as one
    message: one pickle and one pipe write per step instead of one per request."""

    messages: list[Any]


@dataclass
class ControlRequest:
    """A named engine call outside the request path (release a KV lease, state counts, ...)."""

    call_id: int
    name: str
    kwargs: dict[str, Any]


@dataclass
class ControlResult:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class Shutdown:
    pass


@dataclass
class Heartbeat:
    """Sent by a worker every HEARTBEAT_S from a thread of its own, whatever its engine is
    doing: silence means the process is frozen (SIGSTOP, a hung call holding the GIL), which a
    live process id alone does not show."""


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)
