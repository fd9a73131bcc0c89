"""Stage input processors for Qwen2.5-Omni, named in stage YAMLs by `custom_process_input_func`.

`thinker2talker` merges the thinker's talker rows (from one colocated thinker, or from the prefill
and decode legs of a P/D pair) into the talker's prompt. With `async_chunk` its twin
`thinker2talker_stream` starts the talker as soon as the thinker's second token exists and feeds
it each later row as the thinker makes it. `talker2code2wav` hands the talker's codes to
token2wav (vllm-omni calls that stage code2wav); with `async_chunk` its twin
`talker2code2wav_stream` hands them over in chunks as the talker makes them, and token2wav speaks
them as they come.
"""

from __future__ import annotations

import torch

from ...engines.base import StageInputs
from ..thinker_rows import StageInputError, check_streamed, merge_rows, thinker_legs, with_whole_output
from .records import (
    TalkerInputDelta,
    TalkerOutput,
    TalkerPrompt,
    ThinkerChunk,
    ThinkerOutput,
    Token2WavPrompt,
)

__all__ = [
    "StageInputError",
    "talker2code2wav",
    "talker2code2wav_stream",
    "thinker2talker",
    "thinker2talker_stream",
]


def thinker2talker(inputs: StageInputs) -> TalkerPrompt:
    prompt_out, gen_out = thinker_legs(inputs, ThinkerOutput, "prompt_rows", "output_rows")
    prompt_len = len(gen_out.prompt_token_ids)
    rows = merge_rows(
        inputs.request_id,
        "talker rows",
        prompt_out.prompt_rows,
        gen_out.output_rows,
        gen_out.output_start,
        prompt_len,
        prompt_len + max(len(gen_out.token_ids) - 1, 0),  # every generated token but the last was fed back
    )
    return TalkerPrompt(
        request_id=inputs.request_id,
        prompt_token_ids=list(gen_out.prompt_token_ids),
        output_token_ids=list(gen_out.token_ids),
        rows=rows,
        speaker=inputs.speaker or "Chelsie",
    )


class thinker2talker_stream:  # noqa: N801 - named after the processor it streams
    """`thinker2talker` for a thinker that streams its tokens and rows: the talker opens once the
    prompt rows and the first fed-back token's row are there (the prompt rows come from the
    prefill leg's output in P/D, else in the thinker's first chunk), then gets every later row as
    it comes; a decode step of the talker waits for its row, so its codes are the whole output's.
    Rows a decode leg recomputed replace the prefill leg's copy, as `thinker2talker` merges them."""

    def __init__(self, inputs: StageInputs):
        self.inputs = inputs
        prefill = [
            o for o in inputs.upstream.values() if isinstance(o, ThinkerOutput) and o.prompt_rows is not None
        ]
        self.prompt_ids: list[int] | None = list(prefill[0].prompt_token_ids) if prefill else None
        self.prompt_rows = prefill[0].prompt_rows if prefill else None
        self.tokens: list[int] = []
        self.blocks: list[torch.Tensor] = []  # merged rows: the prompt's, then the fed-back tokens'
        self.rows: int | None = None  # merged rows so far (None: no chunk yet)
        self.given_tokens = self.given_blocks = 0  # what the talker has been given
        self.output: ThinkerOutput | None = None
        self.opened = False

    def feed(self, chunk: ThinkerChunk) -> None:
        rid = self.inputs.request_id
        if chunk.prompt_token_ids is not None:
            if self.prompt_ids is not None and chunk.prompt_token_ids != self.prompt_ids:
                raise StageInputError(
                    f"request {rid}: the prefill leg saw a {len(self.prompt_ids)}-token prompt, the "
                    f"decode leg a {len(chunk.prompt_token_ids)}-token one; they must be the same"
                )
            self.prompt_ids = list(chunk.prompt_token_ids)
        if chunk.prompt_rows is not None:
            self.prompt_rows = chunk.prompt_rows
        if self.rows is None:
            if self.prompt_rows is None or self.prompt_rows.shape[0] < chunk.start:
                have = None if self.prompt_rows is None else self.prompt_rows.shape[0]
                raise StageInputError(
                    f"request {rid}: thinker rows from position {chunk.start} arrived before the "
                    f"prompt's rows (have {have})"
                )
            self.blocks.append(self.prompt_rows[: chunk.start])
            self.rows = chunk.start
        if self.rows != chunk.start:
            raise StageInputError(
                f"request {rid}: thinker rows from position {chunk.start} arrived, expected {self.rows}"
            )
        self.tokens.extend(chunk.token_ids)
        if chunk.rows.shape[0]:
            self.blocks.append(chunk.rows)
            self.rows += chunk.rows.shape[0]

    def close(self, output: ThinkerOutput) -> None:
        """The thinker finished: what it streamed must be its whole output."""
        if self.rows is not None:
            check_streamed(self.inputs.request_id, self.tokens, output)
        self.output = output

    def prompt(self) -> TalkerPrompt | None:
        if self.output is not None and not self.opened:
            # Done before the talker could start: the whole-output processor, as without streaming.
            self.opened = True
            return thinker2talker(with_whole_output(self.inputs, self.output))
        if self.prompt_ids is None or self.rows is None or self.rows <= len(self.prompt_ids):
            return None  # the talker's prompt ends with the first fed-back token's row
        self.opened = True
        self.given_tokens, self.given_blocks = len(self.tokens), len(self.blocks)
        return TalkerPrompt(
            request_id=self.inputs.request_id,
            prompt_token_ids=list(self.prompt_ids),
            output_token_ids=list(self.tokens),
            rows=torch.cat(self.blocks),
            speaker=self.inputs.speaker or "Chelsie",
            final=False,
        )

    def take(self) -> tuple[TalkerInputDelta, bool]:
        new = self.blocks[self.given_blocks :]
        width = self.blocks[0].shape[1]
        delta = TalkerInputDelta(
            output_token_ids=self.tokens[self.given_tokens :],
            rows=torch.cat(new) if new else self.blocks[0].new_zeros((0, width)),
        )
        self.given_tokens, self.given_blocks = len(self.tokens), len(self.blocks)
        return delta, self.output is not None


def talker2code2wav(inputs: StageInputs) -> Token2WavPrompt:
    outputs = [o for o in inputs.upstream.values() if isinstance(o, TalkerOutput)]
    if len(outputs) != 1:
        raise StageInputError(
            f"request {inputs.request_id}: token2wav takes one talker output; got {len(outputs)} "
            f"from stages {sorted(inputs.upstream)}"
        )
    return Token2WavPrompt(inputs.request_id, outputs[0].codes, speaker=inputs.speaker or "Chelsie")


class talker2code2wav_stream:  # noqa: N801 - named after the processor it streams
    """`talker2code2wav` for a talker that streams its codes: token2wav opens at once with none
    and gets them in the pieces it decodes (`initial_codec_chunk_frames`, then
    `codec_chunk_frames`), one message per piece."""

    def __init__(self, inputs: StageInputs):
        self.request_id = inputs.request_id
        self.speaker = inputs.speaker or "Chelsie"
        args = inputs.engine_args
        self.first_chunk = getattr(args, "initial_codec_chunk_frames", None) or 1
        self.chunk = getattr(args, "codec_chunk_frames", None) or 1
        self.pending: list[int] = []
        self.seen = 0
        self.sent = 0
        self.closed = False

    @property
    def source_chunk_sizes(self) -> tuple[int, int]:
        return self.first_chunk, self.chunk

    def feed(self, codes: list[int]) -> None:
        self.pending.extend(int(c) for c in codes)
        self.seen += len(codes)

    def close(self, output: TalkerOutput) -> None:
        """The talker finished: its chunks must have been its whole output."""
        if self.seen != output.codes.numel():
            raise StageInputError(
                f"request {self.request_id}: the talker streamed {self.seen} codes but its output has "
                f"{output.codes.numel()}"
            )
        self.closed = True

    def prompt(self) -> Token2WavPrompt:
        codes, final = self.take()
        if codes is None:
            codes = torch.zeros(0, dtype=torch.long)
        return Token2WavPrompt(self.request_id, codes, speaker=self.speaker, final=final)

    def take(self) -> tuple[torch.Tensor | None, bool]:
        """The pending codes once they fill token2wav's next chunk, or whatever is left once the
        talker is done (final); (None, False) until then."""
        needed = self.first_chunk if self.sent == 0 else self.chunk
        if not self.closed and len(self.pending) < needed:
            return None, False
        codes = torch.tensor(self.pending, dtype=torch.long)
        self.sent += len(self.pending)
        self.pending = []
        return codes, self.closed
