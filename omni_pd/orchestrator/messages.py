"""Messages between the orchestrator and a stage worker.

Any number of requests are in flight on one worker: `AddRequest`, `AppendInput` and `Abort` may
arrive at any time, and the worker answers each request with `TokenDelta`s and `ChunkOutput`s
(when streamed) and then exactly one `GenerateResult` or `GenerateFailed`. Control calls are answered by `call_id`.

Sent as bytes pickled with the standard pickler: torch tensors are copied into the message rather
than shared through /dev/shm file descriptors (torch's multiprocessing reducers), so a dead peer
never leaves shared memory behind. A tensor travels as its values only (a CPU numpy array, or raw
bytes for dtypes numpy lacks): torch's own reducer serialises each storage with `torch.save`, which
cost 10x more per message and was a third of the orchestrator's CPU at concurrency 16. Views
arrive as tensors of their own (no storage shared with other tensors of the message).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

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
    # Output units (talker frames) per ChunkOutput, first and later: what the downstream stage
    # decodes per step. None: one ChunkOutput per step.
    chunk_sizes: tuple[int, int] | None = None
    # False: no later stage reads the request's per-token rows (a text-only request): the engine
    # records none and its output carries none.
    rows: bool = True


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
    live process id alone does not show. It carries the engine's load as of its last step
    (`StageEngine.load`), which the orchestrator's router reads."""

    load: dict[str, int] | None = None


def _tensor_from_array(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    values = tensor.detach().cpu().contiguous()
    try:
        return _tensor_from_array, (values.numpy(),)
    except TypeError:  # bfloat16 and other dtypes numpy has no type for
        raw = values.reshape(-1).view(torch.uint8).numpy().tobytes() if values.numel() else b""
        return _tensor_from_bytes, (raw, values.dtype, tuple(values.shape))


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce_tensor  # exact type: Parameters keep torch's reducer


def dumps(message: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)
