"""What a model package gives the generic engines: a runner, behind a small typed protocol.

An autoregressive stage (`ArRunner`) computes a batched prefill of the prompts admitted in a
step and a batched decode step of the requests running, and says which rows per position the
next stage needs; it samples, decides when a request is done, and builds the stage's records.
Its layers call the step's attention (`attention.StepAttention`, which the engine builds with
the step's block tables and positions) with q, k and v: a runner never sees a block or the
cache. The engine (`engines/core/ar_engine.py`) owns everything else: requests, admission,
blocks, the paged and prefix caches, the P/D legs, streaming and its counters, failures.

A chunked stage (`ChunkRunner`, a decoder fed units in chunks, like a codec decoder) turns a
request's units into samples, whole or chunk by chunk with state carried between chunks.

A runner must compute a request's bits independently of its batch (the hf building blocks in
`engines/hf/batch_invariant.py` do that, and its `compute` backend, engines/hf/compute.py, is
batch-invariant too); the engines rely on it for P/D = colocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from ...kv.layout import BlockLayout
from .attention import ComputeBackend, StepAttention

if TYPE_CHECKING:
    from ...sampling import SamplingParams
    from .request import EngineRequest


@dataclass
class PrefillItem:
    """One prompt in a batched prefill: positions `start .. end` are computed; the ones before
    are cached in its first blocks (the prefix cache's, or earlier chunks')."""

    request: "EngineRequest"
    start: int = 0
    # Compute positions start .. end only (None: to the prompt's end): a prompt prefilled in
    # chunks, each over the KV of the ones before (runners with `prefills_in_chunks`).
    end: int | None = None


@dataclass
class Prefilled:
    """A prompt's prefill, however it ran: the one record the engines pass around."""

    logits: torch.Tensor  # [vocab]: the last prompt position's
    # [layers, 2, kv_heads, positions computed, head_dim]: a pass through the step's attention
    # leaves it None and the engine takes it from there; a runner's own whole-prompt path
    # (`prefill_alone`) gives it.
    kv: torch.Tensor | None = None
    # Per prompt position computed, the rows the next stage needs ({} for none).
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    # Scalars a decode leg continues from besides the KV (e.g. a rotary offset), by name: they
    # travel in kv_transfer_params.
    state: dict[str, int] = field(default_factory=dict)
    first_token: int | None = None  # sampled by the engine
    prefill_ms: float = 0.0

    @property
    def computed_kv(self) -> torch.Tensor:
        """`kv`, which the engine's prefill pass always fills."""
        if self.kv is None:
            raise RuntimeError("a prefill's KV is taken from its attention pass (ArEngine.compute_prefill)")
        return self.kv


@dataclass
class DecodeResult:
    logits: torch.Tensor  # [B, vocab]


@dataclass(frozen=True)
class RunnerIdentity:
    """What the KV fingerprint says of a runner: what its KV means, and what computed it."""

    model: str
    weights: str  # a digest of its weights
    device: str
    native_kernels: Mapping[str, str]  # native build ids of the kernels it computes with


class ArRunner(Protocol):
    """An autoregressive stage's model, batched."""

    name: str  # the model stage, as logs and per-request counters name it
    device: str  # where its weights are: the engine's paged cache lives there too
    # Whether its prompts have token ids a prefix cache can name blocks by.
    caches_prefixes: bool
    # Rows per prompt position the next stage needs (name -> width), kept beside cached blocks.
    row_widths: Mapping[str, int]
    row_dtype: torch.dtype
    # Scalars a decode leg continues from besides the KV (`Prefilled.state`'s keys).
    handoff_keys: tuple[str, ...]
    # Whether its tokens are text (streamed to the client as token deltas).
    emits_text: bool
    # Whether `prefill` honours PrefillItem.end (ArRunnerBase: no).
    prefills_in_chunks: bool
    # The kernels its attention runs on, its batch-invariance switch and compute identity.
    compute: ComputeBackend
    # How its prompts' rows attend (attention.PROMPT_ATTENTION).
    prompt_attention: str

    def kv_layout(self, block_size: int) -> BlockLayout: ...

    def identity(self) -> RunnerIdentity: ...

    def new_request(self, request_id: str, prompt: Any, params: "SamplingParams") -> "EngineRequest":
        """A new request's record, checked (ValueError naming what to change): its prompt
        length and ids, `multimodal_spans` (what the prefix cache's block names must include),
        `batchable`, and `model` (the runner's per-request state)."""

    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        """The batchable prompts admitted in a step, in one pass: logits and rows of the
        positions each computes, their attention through `attention` (which knows each
        prompt's cached prefix and keeps the KV computed)."""

    def prefill_alone(self, request: "EngineRequest") -> Prefilled:
        """A prompt the batched pass cannot take (`batchable` False), whole."""

    def decode(self, requests: Sequence["EngineRequest"], attention: StepAttention) -> DecodeResult:
        """One token for each running request (its latest token fed in at `position`), attention
        through `attention` (which writes the new KV into the request's blocks); keeps the
        fed-in tokens' rows in their state."""

    def sample(
        self, requests: Sequence["EngineRequest"], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        """The next token of each request from its row of `logits`; an Exception for a row that
        failed alone. `first`: the logits are the prompts' last positions."""

    def prefilled(self, request: "EngineRequest", result: Prefilled) -> None:
        """Keep what the request needs of its prefill (rows for its output, state)."""

    def resume(self, request: "EngineRequest", state: Mapping[str, int]) -> None:
        """A decode leg's request whose KV arrived: the prefill's `state` (handoff_keys)."""

    def restart(self, request: "EngineRequest") -> None:
        """A preempted request is computed again from its prompt: forget what was computed
        from the prompt on (outputs, rows, traces), keep its inputs and what was already sent
        (the engine sends nothing until the request is past it again)."""

    def finish_reason(self, request: "EngineRequest") -> str | None:
        """'stop', 'length' (or another reason) once the latest token ends the request."""

    def output(self, request: "EngineRequest", reason: str) -> Any:
        """The finished request's output record (a prefill leg's, `request.publishes`, describes
        the prompt and its first token; the engine adds kv_transfer_params)."""

    def chunk(self, request: "EngineRequest", new_tokens: list[int], first: bool, finished: bool) -> Any:
        """A streamed request's chunk for the stage that runs alongside (None: none now).
        `new_tokens`: its tokens since the last call; `first`: no chunk sent yet."""

    # Hooks with do-nothing defaults (ArRunnerBase).
    def ready(self, request: "EngineRequest") -> bool: ...

    def append_input(self, request: "EngineRequest", data: Any, final: bool) -> None: ...

    def before_step(self, requests: Sequence["EngineRequest"]) -> list[tuple["EngineRequest", str]]: ...

    def pending(self, requests: Sequence["EngineRequest"]) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


class ArRunnerBase:
    """Defaults for an `ArRunner`'s optional hooks (no state of its own)."""

    caches_prefixes: bool = False
    row_widths: Mapping[str, int] = {}
    row_dtype: torch.dtype = torch.float32
    handoff_keys: tuple[str, ...] = ()
    emits_text: bool = True
    # Whether `prefill` honours PrefillItem.end (a push prefills in chunks with it).
    prefills_in_chunks: bool = False
    prompt_attention: str = "row_invariant"

    def prefilled(self, request: "EngineRequest", result: Prefilled) -> None:
        pass

    def resume(self, request: "EngineRequest", state: Mapping[str, int]) -> None:
        pass

    def restart(self, request: "EngineRequest") -> None:
        if request.model is not None:  # a runner with per-request state says what to forget
            raise NotImplementedError(
                f"the {getattr(self, 'name', 'model')} runner cannot compute a preempted request again"
            )

    def ready(self, request: "EngineRequest") -> bool:
        """Whether a running request can decode this step (a stage fed while its source still
        runs may wait for more input)."""
        return True

    def append_input(self, request: "EngineRequest", data: Any, final: bool) -> None:
        raise ValueError(f"the {getattr(self, 'name', 'model')} stage does not take streamed input")

    def before_step(self, requests: Sequence["EngineRequest"]) -> list[tuple["EngineRequest", str]]:
        """Work on appended input before the step (for all requests at once); returns the
        requests that failed alone, with why."""
        return []

    def pending(self, requests: Sequence["EngineRequest"]) -> bool:
        """Whether `before_step` has work even if no request can decode."""
        return False

    def describe(self) -> dict[str, Any]:
        """Facts the engine's `describe()` adds (StageEngine.describe)."""
        return {}


@runtime_checkable
class ChunkRunner(Protocol):
    """A decoder fed units in chunks (a codec decoder: codes in, samples out)."""

    name: str
    sample_rate: int

    def read_prompt(self, request_id: str, prompt: Any) -> tuple[torch.Tensor, bool]:
        """A prompt's units as the decoder takes them, checked, and whether more will follow
        through `append_input` (False) or the prompt is the whole utterance (True)."""

    def check_units(self, request_id: str, units: Any) -> torch.Tensor:
        """`units` as the decoder takes them ([groups, n]), or ValueError naming the shape."""

    def new_stream(self, prompt: Any) -> Any:
        """The state carried from chunk to chunk of one request, and what the request is
        conditioned on besides its units (`prompt`: e.g. a voice)."""

    def decode_chunk(self, state: Any, units: torch.Tensor, left_context: int | None) -> torch.Tensor:
        """Samples for `units` (the next chunk), continuing `state`."""

    def decode_whole(self, request_id: str, units: torch.Tensor, state: Any) -> torch.Tensor:
        """Samples for a whole utterance at once (`state`: its `new_stream`)."""

    def exact_left_context(self) -> int:
        """Frames of left context that keep re-decoded chunks exact (the receptive field)."""

    # Optional: `flush(state) -> Tensor`, the samples a decoder that looks ahead held back,
    # called once a streamed request's last units are in (after its last `decode_chunk`).

    def describe(self) -> dict[str, Any]: ...
