"""code2wav as a step engine: whole utterances, or utterances streamed in from the talker.

A whole utterance (its prompt is final) is decoded in one step. A streamed one (`final=False`,
more frames arriving through `append_input`) is decoded chunk by chunk as its frames arrive:
`initial_codec_chunk_frames` first, for a short time to first audio, then `codec_chunk_frames`
at a time. By default every layer carries its state from chunk to chunk (the pre-transformer's
keys and values, each convolution's input tail), so no frame is decoded twice; with
`codec_left_context_frames` set, the decoder instead re-runs that many frames before each chunk
(vllm-omni's way), exact when they cover its receptive field (derived from the config). Either
way the chunks add up to the whole-utterance waveform exactly. Each chunk's samples leave in the
step that decoded them. One chunk per step, of the ready request with the fewest chunks out
(oldest first among equals), so a new request's first chunk does not queue behind the later
chunks of requests already playing; new requests and aborts are taken between chunks.

Requests are not stacked into one forward pass. With transformers' kernels that was neither
batch-invariant nor faster (16 utterances of 63 frames: 0.36 s one by one, 1.36 s as one batch, on
the 2-core CI machine); the exact kernels would stay exact stacked along time, but whether that
pays on a CPU, where the cost is per-sample arithmetic, is not measured yet.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_pd.sampling import SamplingParams
from omni_pd.engines.base import StageEngine, StepOutput
from omni_pd.engines.types import AudioOutput
from omni_pd.models.qwen3_omni.records import Code2WavPrompt
from ..stage_parts import StageParts
from .code2wav import SAMPLE_RATE, Code2WavRunner
from .code2wav_exact import Code2WavStream

log = logging.getLogger(__name__)


@dataclass
class _Utterance:
    """One request's codes and progress; dropping it frees everything it holds."""

    request_id: str
    codes: torch.Tensor  # [num_quantizers, frames received]
    final: bool  # no more frames will come
    stream: bool  # send each chunk's samples as it is decoded
    decoded: int = 0  # frames whose samples have been produced
    carried: Code2WavStream = field(default_factory=Code2WavStream)  # state between chunks
    pieces: list[torch.Tensor] = field(default_factory=list)
    began: float = field(default_factory=time.perf_counter)
    first_chunk_ms: float | None = None

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


class HfCode2WavEngine(StageEngine):
    control_calls = StageEngine.control_calls | {"set_left_context_frames", "inject_chunk_fault"}

    def __init__(self, stage_id: int, model, initial_chunk_frames: int = 4, chunk_frames: int = 25,
                 left_context_frames: int | None = None, kernels: str = "native"):
        self.stage_id = stage_id
        parts = StageParts.of(model)  # a whole model, or a code2wav stage's parts
        self.runner = Code2WavRunner(parts.require("code2wav"), kernels)
        self.num_quantizers = parts.config.code2wav_config.num_quantizers
        geometry = self.runner.geometry
        self.initial_chunk_frames = int(initial_chunk_frames)
        self.chunk_frames = int(chunk_frames)
        # None: carry every layer's state between chunks. A number: re-decode that much left
        # context (the pre-transformer's window is carried either way, so the context only has
        # to cover the convolutional decoder's receptive field).
        exact = geometry.decoder_frames
        self.left_context_frames = None if left_context_frames is None else int(left_context_frames)
        if self.left_context_frames is not None and self.left_context_frames < exact:
            log.warning("stage %d: codec_left_context_frames %d is below code2wav's decoder "
                        "receptive field of %d frames: streamed audio will differ slightly from "
                        "whole-utterance audio at chunk joins; remove the key (or set %d) for "
                        "exact chunks", stage_id, self.left_context_frames, exact, exact)
        self._utterances: OrderedDict[str, _Utterance] = OrderedDict()
        self._fault_after_chunks: int | None = None  # test hook: fail the next streamed utterance

    def describe(self) -> dict[str, Any]:
        return {"engine": "hf-code2wav", "initial_codec_chunk_frames": self.initial_chunk_frames,
                "codec_chunk_frames": self.chunk_frames,
                "codec_left_context_frames": self.left_context_frames,
                "decoder_receptive_field_frames": self.runner.geometry.decoder_frames,
                "code2wav_kernels": self.runner.exact.kernels}

    def set_left_context_frames(self, frames: int | None) -> int | None:
        """Test hook: a left context below the receptive field, for end-to-end negative controls
        (None: back to carried state). Returns the previous value."""
        previous = self.left_context_frames
        self.left_context_frames = None if frames is None else int(frames)
        return previous

    def inject_chunk_fault(self, after_chunks: int) -> None:
        """Test hook: the next streamed utterance fails when decoding its chunk number
        `after_chunks` + 1, as a stage failing mid-stream would."""
        self._fault_after_chunks = int(after_chunks)

    # -- requests -------------------------------------------------------------------------------

    def _check_codes(self, request_id: str, codes: Any) -> torch.Tensor:
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[0] != self.num_quantizers:
            shape = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(f"request {request_id}: codes must be a [{self.num_quantizers}, frames] "
                             f"tensor, got {shape}")
        return codes.to(torch.long)

    def add_request(self, request_id: str, prompt: Code2WavPrompt, params: SamplingParams,
                    stream: bool = False, chunks: bool = False,
                    chunk_sizes: tuple[int, int] | None = None) -> None:
        if request_id in self._utterances:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        codes = self._check_codes(request_id, prompt.codes)
        self._utterances[request_id] = _Utterance(request_id, codes, final=prompt.final,
                                                  stream=stream or chunks)

    def append_input(self, request_id: str, data: Any, final: bool) -> None:
        utterance = self._utterances.get(request_id)
        if utterance is None:
            raise ValueError(f"stage {self.stage_id} holds no request {request_id}")
        if utterance.final:
            raise ValueError(f"request {request_id}: frames arrived after the last ones")
        codes = self._check_codes(request_id, data)
        if codes.shape[1]:
            utterance.codes = torch.cat([utterance.codes, codes], dim=1)
        utterance.final = bool(final)

    def abort_request(self, request_id: str) -> None:
        self._utterances.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._utterances)

    def debug_state_counts(self) -> dict[str, int]:
        return {"code2wav.requests": len(self._utterances)}

    # -- the step loop --------------------------------------------------------------------------

    def _next_chunk(self, u: _Utterance) -> int | None:
        """Frames to decode for `u` now (0: finish with nothing left), or None: wait for input."""
        pending = u.frames - u.decoded
        if not u.stream:
            return pending if u.final else None
        want = self.initial_chunk_frames if u.decoded == 0 else self.chunk_frames
        if pending >= want:
            return want
        return pending if u.final else None

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a request waiting for frames is not work."""
        return any(self._next_chunk(u) is not None for u in self._utterances.values())

    def step(self) -> list[StepOutput]:
        # The ready utterance with the fewest chunks out, oldest first among equals: a new
        # request's first chunk (its time to first audio) does not queue behind the later
        # chunks of requests that are already playing.
        ready = [(len(u.pieces), index, u, n) for index, u in enumerate(self._utterances.values())
                 if (n := self._next_chunk(u)) is not None]
        if not ready:
            return []
        _, _, u, frames = min(ready, key=lambda item: item[:2])
        try:
            if frames:
                start, end = u.decoded, u.decoded + frames
                if u.stream and self._fault_after_chunks == len(u.pieces):
                    self._fault_after_chunks = None
                    raise RuntimeError("injected fault (inject_chunk_fault)")
                if u.stream:
                    piece = self.runner.decode_chunk(u.carried, u.codes[:, start:end],
                                                     self.left_context_frames)
                else:
                    piece = self.runner.generate(Code2WavPrompt(u.request_id, u.codes[:, :end])).audio
                u.pieces.append(piece)
                u.decoded = end
                if u.first_chunk_ms is None:
                    u.first_chunk_ms = (time.perf_counter() - u.began) * 1e3
            else:
                piece = None
        except Exception as exc:  # noqa: BLE001 - one utterance at a time: fail just this one
            log.exception("code2wav failed for %s", u.request_id)
            del self._utterances[u.request_id]
            return [StepOutput.failed(u.request_id, f"code2wav: {type(exc).__name__}: {exc}")]
        chunk = (AudioOutput(u.request_id, piece, SAMPLE_RATE)
                 if u.stream and piece is not None and piece.numel() else None)
        if not (u.final and u.decoded == u.frames):
            return [StepOutput(u.request_id, chunk=chunk)]
        del self._utterances[u.request_id]
        metrics = {"code2wav_ms": (time.perf_counter() - u.began) * 1e3, "chunks": len(u.pieces)}
        if u.stream:  # every sample has left in a chunk already
            output = AudioOutput(request_id=u.request_id, audio=torch.zeros(0), sample_rate=SAMPLE_RATE,
                                 metrics=metrics, samples_in_chunks=True)
        else:
            audio = torch.cat(u.pieces) if u.pieces else torch.zeros(0)
            output = AudioOutput(request_id=u.request_id, audio=audio, sample_rate=SAMPLE_RATE,
                                 metrics=metrics)
        return [StepOutput(u.request_id, chunk=chunk, finished=True, output=output)]
