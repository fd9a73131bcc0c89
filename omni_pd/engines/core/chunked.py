"""A chunked decoder stage as a step engine, for any model's `ChunkRunner`: units in (a codec's
codes), samples out, whole utterances or utterances streamed in from the previous stage.

A whole utterance (its prompt is final) is decoded in one step. A streamed one (`final=False`,
more units arriving through `append_input`) is decoded chunk by chunk as its units arrive:
`initial_codec_chunk_frames` first, for a short time to first audio, then `codec_chunk_frames`
at a time. By default the runner carries every layer's state from chunk to chunk, so no unit is
decoded twice; with `codec_left_context_frames` set, it re-runs that many units before each
chunk instead (vllm-omni's way), exact when they cover the decoder's receptive field. Either way
a runner whose streaming is exact (a causal codec decoder) makes chunks that add up to the
whole-utterance samples; a runner that streams in a mode of its own (a windowed diffusion
decoder) says so, and holds back what its look-ahead needs until `flush`. Each chunk's samples
leave in the step that decoded them. One chunk per step, of the ready request with the fewest chunks out (oldest
first among equals), so a new request's first chunk does not queue behind the later chunks of
requests already playing; new requests and aborts are taken between chunks.

Requests are not stacked into one forward pass: a chunked decoder's cost on a CPU is per-sample
arithmetic, and stacking would save only the per-call overhead.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import faults
from ...sampling import SamplingParams
from ..base import StageEngine, StepOutput
from ..types import AudioOutput
from .runner import ChunkRunner

log = logging.getLogger(__name__)


@dataclass
class Utterance:
    """One request's units and progress; dropping it frees everything it holds."""

    request_id: str
    units: torch.Tensor  # [groups, units received]
    final: bool  # no more units will come
    stream: bool  # send each chunk's samples as it is decoded
    carried: Any  # the runner's state between chunks
    decoded: int = 0  # units whose samples have been produced
    pieces: list[torch.Tensor] = field(default_factory=list)
    began: float = field(default_factory=time.perf_counter)
    first_chunk_ms: float | None = None

    @property
    def received(self) -> int:
        return self.units.shape[1]


class ChunkedEngine(StageEngine):
    control_calls = StageEngine.control_calls | {"set_left_context_frames"}

    def __init__(
        self,
        stage_id: int,
        runner: ChunkRunner,
        initial_chunk_frames: int = 4,
        chunk_frames: int = 25,
        left_context_frames: int | None = None,
    ):
        self.stage_id = stage_id
        self.runner = runner
        self.name = runner.name
        self.initial_chunk_frames = int(initial_chunk_frames)
        self.chunk_frames = int(chunk_frames)
        # None: carry every layer's state between chunks. A number: re-decode that much left
        # context (exact from the decoder's receptive field up).
        exact = runner.exact_left_context()
        self.left_context_frames = None if left_context_frames is None else int(left_context_frames)
        if self.left_context_frames is not None and self.left_context_frames < exact:
            log.warning(
                "stage %d: codec_left_context_frames %d is below %s's decoder receptive "
                "field of %d frames: streamed audio will differ slightly from "
                "whole-utterance audio at chunk joins; remove the key (or set %d) for "
                "exact chunks",
                stage_id,
                self.left_context_frames,
                self.name,
                exact,
                exact,
            )
        self._utterances: OrderedDict[str, Utterance] = OrderedDict()

    def describe(self) -> dict[str, Any]:
        return {
            "engine": f"hf-{self.name}",
            "initial_codec_chunk_frames": self.initial_chunk_frames,
            "codec_chunk_frames": self.chunk_frames,
            "codec_left_context_frames": self.left_context_frames,
            "decoder_receptive_field_frames": self.runner.exact_left_context(),
            **self.runner.describe(),
        }

    def set_left_context_frames(self, frames: int | None) -> int | None:
        """Test hook: a left context below the receptive field, for end-to-end negative controls
        (None: back to carried state). Returns the previous value."""
        previous = self.left_context_frames
        self.left_context_frames = None if frames is None else int(frames)
        return previous

    @staticmethod
    def _fault_strikes(pieces: int) -> bool:
        """The chunked.stream.fail fault hook (test-only, omni_pd/faults.py): the next streamed
        utterance fails when decoding its chunk number `after_chunks` + 1, as a stage failing
        mid-stream would. False unless a test armed it."""
        fault = faults.peek("chunked.stream.fail")
        if fault is None or fault["after_chunks"] != pieces:
            return False
        faults.disarm("chunked.stream.fail")
        return True

    # -- requests -------------------------------------------------------------------------------

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
        if request_id in self._utterances:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        units, final = self.runner.read_prompt(request_id, prompt)
        self._utterances[request_id] = Utterance(
            request_id, units, final=final, stream=stream or chunks, carried=self.runner.new_stream(prompt)
        )

    def append_input(self, request_id: str, data: Any, final: bool) -> None:
        utterance = self._utterances.get(request_id)
        if utterance is None:
            raise ValueError(f"stage {self.stage_id} holds no request {request_id}")
        if utterance.final:
            raise ValueError(f"request {request_id}: frames arrived after the last ones")
        units = self.runner.check_units(request_id, data)
        if units.shape[1]:
            utterance.units = torch.cat([utterance.units, units], dim=1)
        utterance.final = bool(final)

    def abort_request(self, request_id: str) -> None:
        self._utterances.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._utterances)

    def debug_state_counts(self) -> dict[str, int]:
        return {f"{self.name}.requests": len(self._utterances)}

    # -- the step loop --------------------------------------------------------------------------

    def _next_chunk(self, u: Utterance) -> int | None:
        """Units to decode for `u` now (0: finish with nothing left), or None: wait for input."""
        pending = u.received - u.decoded
        if not u.stream:
            return pending if u.final else None
        want = self.initial_chunk_frames if u.decoded == 0 else self.chunk_frames
        if pending >= want:
            return want
        return pending if u.final else None

    def _flush(self, u: Utterance, piece: torch.Tensor | None) -> torch.Tensor | None:
        """A streamed utterance's last units are in: the samples a decoder that looks ahead held
        back (its `flush`; none for a decoder without one) join this step's chunk."""
        flush = getattr(self.runner, "flush", None)
        tail = flush(u.carried) if flush is not None else None
        if tail is None or not tail.numel():
            return piece
        u.pieces.append(tail)
        return tail if piece is None else torch.cat([piece, tail])

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a request waiting for units is not work."""
        return any(self._next_chunk(u) is not None for u in self._utterances.values())

    def step(self) -> list[StepOutput]:
        # The ready utterance with the fewest chunks out, oldest first among equals: a new
        # request's first chunk (its time to first audio) does not queue behind the later
        # chunks of requests that are already playing.
        ready = [
            (len(u.pieces), index, u, n)
            for index, u in enumerate(self._utterances.values())
            if (n := self._next_chunk(u)) is not None
        ]
        if not ready:
            return []
        _, _, u, count = min(ready, key=lambda item: item[:2])
        piece: torch.Tensor | None = None
        try:
            if count:
                start, end = u.decoded, u.decoded + count
                if u.stream and self._fault_strikes(len(u.pieces)):
                    raise RuntimeError("injected fault (chunked.stream.fail fault hook)")
                if u.stream:
                    piece = self.runner.decode_chunk(
                        u.carried, u.units[:, start:end], self.left_context_frames
                    )
                else:
                    piece = self.runner.decode_whole(u.request_id, u.units[:, :end], u.carried)
                u.pieces.append(piece)
                u.decoded = end
                if u.first_chunk_ms is None:
                    u.first_chunk_ms = (time.perf_counter() - u.began) * 1e3
            if u.stream and u.final and u.decoded == u.received:
                piece = self._flush(u, piece)
        except Exception as exc:  # noqa: BLE001 - one utterance at a time: fail just this one
            log.exception("%s failed for %s", self.name, u.request_id)
            del self._utterances[u.request_id]
            return [StepOutput.failed(u.request_id, f"{self.name}: {type(exc).__name__}: {exc}")]
        rate = self.runner.sample_rate
        chunk = (
            AudioOutput(u.request_id, piece, rate)
            if u.stream and piece is not None and piece.numel()
            else None
        )
        if not (u.final and u.decoded == u.received):
            return [StepOutput(u.request_id, chunk=chunk)]
        del self._utterances[u.request_id]
        metrics = {f"{self.name}_ms": (time.perf_counter() - u.began) * 1e3, "chunks": len(u.pieces)}
        if u.stream:  # every sample has left in a chunk already
            output = AudioOutput(
                request_id=u.request_id,
                audio=torch.zeros(0),
                sample_rate=rate,
                metrics=metrics,
                samples_in_chunks=True,
            )
        else:
            audio = torch.cat(u.pieces) if u.pieces else torch.zeros(0)
            output = AudioOutput(request_id=u.request_id, audio=audio, sample_rate=rate, metrics=metrics)
        return [StepOutput(u.request_id, chunk=chunk, finished=True, output=output)]
