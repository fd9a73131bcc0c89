"""Stage input processors for Qwen3-Omni, named in stage YAMLs by `custom_process_input_func`.

They know Qwen3-Omni's data, not processes or engines: `thinker2talker` merges the thinker's
prompt embeddings with its generated-token embeddings (from one colocated thinker, or from the
prefill and decode legs of a P/D pair) and `talker2code2wav` bounds the codec codes.

A processor `X` may have a streaming counterpart `X_stream` (used with the pipeline's
`async_chunk`): built with the same StageInputs when the upstream stage starts, it is fed each
upstream chunk (`feed`) and finally the upstream output (`close`); `prompt()` gives the
downstream stage's opening prompt as soon as there is enough input for one (None before), and
`take()` the input that arrived since (and whether it is the last). In total the downstream
stage gets exactly what `X` would build from the whole upstream output.
"""

from __future__ import annotations

import logging

import torch

from ...engines.base import StageInputs
from ..thinker_rows import (
    StageInputError,
    check_streamed,
    merge_rows as _merge_rows,
    thinker_legs,
    with_whole_output,
)
from .records import Code2WavPrompt, TalkerInputDelta, TalkerOutput, TalkerPrompt, ThinkerChunk, ThinkerOutput

log = logging.getLogger(__name__)


def thinker2talker(inputs: StageInputs) -> TalkerPrompt:
    prompt_out, gen_out = thinker_legs(inputs, ThinkerOutput, "prompt_embeds", "output_embeds")
    prompt_len = len(gen_out.prompt_token_ids)
    # Every generated token but the last was fed back through the thinker.
    expected = prompt_len + max(len(gen_out.token_ids) - 1, 0)
    embeds = _merge_rows(
        inputs.request_id,
        "embeddings",
        prompt_out.prompt_embeds,
        gen_out.output_embeds,
        gen_out.output_start,
        prompt_len,
        expected,
    )
    hidden = _merge_rows(
        inputs.request_id,
        "hidden states",
        prompt_out.prompt_hidden,
        gen_out.output_hidden,
        gen_out.output_start,
        prompt_len,
        expected,
    )
    return TalkerPrompt(
        request_id=inputs.request_id,
        prompt_token_ids=list(gen_out.prompt_token_ids),
        output_token_ids=list(gen_out.token_ids),
        thinker_embeds=embeds,
        thinker_hidden=hidden,
        speaker=inputs.speaker,
    )


def _speech_frames(frames: list[list[int]], c2w, already: int) -> tuple[int, bool]:
    """How many leading `frames` are speech, given `already` frames were taken before, and
    whether the speech ends among them. A frame with an id outside the codebook (an
    end-of-speech or control code) ends the speech; so does code2wav's position limit."""
    keep = next(
        (i for i, frame in enumerate(frames) if any(code < 0 or code >= c2w.codebook_size for code in frame)),
        len(frames),
    )
    keep = max(min(keep, c2w.max_position_embeddings - already), 0)
    return keep, keep < len(frames)


def _check_frames(request_id: str, frames: list[list[int]], c2w) -> None:
    if any(len(frame) != c2w.num_quantizers for frame in frames):
        raise StageInputError(
            f"request {request_id}: codec frames must have {c2w.num_quantizers} "
            f"codes each, got {sorted({len(f) for f in frames})}"
        )


def _log_dropped(request_id: str, kept: int, frames: int, c2w) -> None:
    log.warning(
        "request %s: code2wav takes %d of %d codec frames (ids must be below %d, at most "
        "%d frames); the rest is dropped",
        request_id,
        kept,
        frames,
        c2w.codebook_size,
        c2w.max_position_embeddings,
    )


def _talker_output(inputs: StageInputs) -> TalkerOutput:
    sources = [inputs.upstream[s] for s in inputs.source_stage_ids if s in inputs.upstream]
    talker_outputs = [o for o in sources if isinstance(o, TalkerOutput)]
    if len(talker_outputs) != 1:
        raise StageInputError(
            f"request {inputs.request_id}: stage {inputs.stage_id} needs one talker "
            f"output among its sources {inputs.source_stage_ids}"
        )
    return talker_outputs[0]


def talker2code2wav(inputs: StageInputs) -> Code2WavPrompt:
    codes = _talker_output(inputs).codes
    c2w = inputs.model_config.code2wav_config
    if codes.dim() != 2 or codes.shape[0] != c2w.num_quantizers:
        raise StageInputError(
            f"request {inputs.request_id}: codes have shape {tuple(codes.shape)}, "
            f"code2wav takes [{c2w.num_quantizers}, frames]"
        )
    keep, ended = _speech_frames(codes.t().tolist(), c2w, 0)
    if ended:
        _log_dropped(inputs.request_id, keep, codes.shape[1], c2w)
    return Code2WavPrompt(request_id=inputs.request_id, codes=codes[:, :keep].contiguous())


class talker2code2wav_stream:  # noqa: N801 - named after the processor it streams
    """`talker2code2wav` for a talker that streams its frames: code2wav opens at once with no
    frames and gets the speech frames (the frames `talker2code2wav` keeps) in the pieces it
    decodes (`initial_codec_chunk_frames`, then `codec_chunk_frames`): one message per chunk
    rather than one per frame."""

    def __init__(self, inputs: StageInputs):
        self.request_id = inputs.request_id
        self.c2w = inputs.model_config.code2wav_config
        args = inputs.engine_args
        self.first_chunk = getattr(args, "initial_codec_chunk_frames", None) or 1
        self.chunk = getattr(args, "codec_chunk_frames", None) or 1
        self.pending: list[list[int]] = []  # speech frames not sent yet
        self.kept = 0  # speech frames so far (sent or pending)
        self.seen = 0  # frames received
        self.ended = False  # the speech ended (a control code, or code2wav's position limit)
        self.closed = False

    @property
    def source_chunk_sizes(self) -> tuple[int, int]:
        """The talker's frames per chunk (first, later) that fill code2wav's chunks as they come:
        the talker sends them so, not one message per frame."""
        return self.first_chunk, self.chunk

    def feed(self, frames: list[list[int]]) -> None:
        """A talker chunk: its new frames, each [code0, ..., code_{G-1}]."""
        _check_frames(self.request_id, frames, self.c2w)
        self.seen += len(frames)
        if self.ended:
            return
        keep, self.ended = _speech_frames(frames, self.c2w, self.kept)
        self.pending.extend(frames[:keep])
        self.kept += keep

    def close(self, output: TalkerOutput) -> None:
        """The talker finished: its chunks must have been its whole output."""
        if self.seen != output.codes.shape[1]:
            raise StageInputError(
                f"request {self.request_id}: the talker streamed {self.seen} "
                f"frames but its output has {output.codes.shape[1]}"
            )
        if self.kept < self.seen:
            _log_dropped(self.request_id, self.kept, self.seen, self.c2w)
        self.closed = True

    def prompt(self) -> Code2WavPrompt:
        codes, final = self.take()
        if codes is None:
            codes = torch.zeros((self.c2w.num_quantizers, 0), dtype=torch.long)
        return Code2WavPrompt(request_id=self.request_id, codes=codes, final=final)

    def take(self) -> tuple[torch.Tensor | None, bool]:
        """The pending frames as codes [num_quantizers, n] once they fill code2wav's next chunk,
        or whatever is left once the talker is done (final); (None, False) until then."""
        sent = self.kept - len(self.pending)
        needed = self.first_chunk - sent if sent < self.first_chunk else self.chunk
        if not self.closed and len(self.pending) < needed:
            return None, False
        codes = (
            torch.tensor(self.pending, dtype=torch.long).t().contiguous()
            if self.pending
            else torch.zeros((self.c2w.num_quantizers, 0), dtype=torch.long)
        )
        self.pending = []
        return codes, self.closed


class thinker2talker_stream:  # noqa: N801 - named after the processor it streams
    """`thinker2talker` for a thinker that streams its tokens and rows: the talker opens once
    the prompt rows and the first generated token's row are there (the prompt rows come from
    the prefill leg's output in P/D, else in the thinker's first chunk), and then gets every
    later token and row as it comes. The rows are merged across P/D legs as `thinker2talker`
    merges them."""

    def __init__(self, inputs: StageInputs):
        self.inputs = inputs
        prefill = [
            o
            for o in inputs.upstream.values()
            if isinstance(o, ThinkerOutput) and o.prompt_embeds is not None
        ]
        self.prompt_ids: list[int] | None = list(prefill[0].prompt_token_ids) if prefill else None
        self.prompt_embeds = prefill[0].prompt_embeds if prefill else None
        self.prompt_hidden = prefill[0].prompt_hidden if prefill else None
        self.tokens: list[int] = []
        self.embeds: list[torch.Tensor] = []  # merged rows: prompt part, then output rows
        self.hidden: torch.Tensor | None = None  # prompt part only: all the talker reads
        self.rows = 0  # merged rows so far
        self.output_start: int | None = None
        self.given_tokens = self.given_blocks = 0  # what the talker has been given
        self.output: ThinkerOutput | None = None
        self.opened = False

    def feed(self, chunk: ThinkerChunk) -> None:
        if chunk.prompt_token_ids is not None:
            if self.prompt_ids is not None and chunk.prompt_token_ids != self.prompt_ids:
                raise StageInputError(
                    f"request {self.inputs.request_id}: the prefill leg saw a "
                    f"{len(self.prompt_ids)}-token prompt, the decode leg a "
                    f"{len(chunk.prompt_token_ids)}-token one; they must be the same"
                )
            self.prompt_ids = list(chunk.prompt_token_ids)
        if chunk.prompt_embeds is not None:
            self.prompt_embeds, self.prompt_hidden = chunk.prompt_embeds, chunk.prompt_hidden
        if self.output_start is None and self.prompt_embeds is not None:
            # Rows the decode leg recomputed replace the prefill leg's copy of those positions.
            self.output_start = chunk.start
            _merge_rows(
                self.inputs.request_id,
                "embeddings",
                self.prompt_embeds,
                chunk.embeds,
                chunk.start,
                len(self.prompt_ids),
                chunk.start + chunk.embeds.shape[0],
            )
            self.embeds.append(self.prompt_embeds[: chunk.start])
            self.hidden = self.prompt_hidden[: chunk.start]
            self.rows = chunk.start
        if self.rows != chunk.start:
            raise StageInputError(
                f"request {self.inputs.request_id}: thinker rows from position "
                f"{chunk.start} arrived, expected {self.rows}"
            )
        self.tokens.extend(chunk.token_ids)
        if chunk.embeds.shape[0]:
            self.embeds.append(chunk.embeds)
            self.rows += chunk.embeds.shape[0]

    def close(self, output: ThinkerOutput) -> None:
        """The thinker finished: what it streamed must be its whole output."""
        if self.output_start is not None:
            check_streamed(self.inputs.request_id, self.tokens, output)
        self.output = output

    def prompt(self) -> TalkerPrompt | None:
        if self.output is not None and not self.opened:
            # Done before the talker could start: the whole-output processor, as without streaming.
            self.opened = True
            return thinker2talker(with_whole_output(self.inputs, self.output))
        if self.prompt_ids is None or self.rows <= len(self.prompt_ids) or not self.tokens:
            return None  # the talker's prefill needs the first generated token's row
        self.opened = True
        embeds = torch.cat(self.embeds)
        self.given_tokens, self.given_blocks = len(self.tokens), len(self.embeds)
        return TalkerPrompt(
            request_id=self.inputs.request_id,
            prompt_token_ids=list(self.prompt_ids),
            output_token_ids=list(self.tokens),
            thinker_embeds=embeds,
            thinker_hidden=self.hidden,
            speaker=self.inputs.speaker,
            final=False,
        )

    def take(self) -> tuple[TalkerInputDelta, bool]:
        width = self.embeds[0].shape[1]
        new_embeds = self.embeds[self.given_blocks :]
        delta = TalkerInputDelta(
            output_token_ids=self.tokens[self.given_tokens :],
            thinker_embeds=torch.cat(new_embeds) if new_embeds else torch.zeros((0, width)),
        )
        self.given_tokens, self.given_blocks = len(self.tokens), len(self.embeds)
        return delta, self.output is not None
