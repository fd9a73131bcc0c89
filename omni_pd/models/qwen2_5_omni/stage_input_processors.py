"""Stage input processors for Qwen2.5-Omni, named in stage YAMLs by `custom_process_input_func`.

`thinker2talker` merges the thinker's talker rows (from one colocated thinker, or from the prefill
and decode legs of a P/D pair) into the talker's prompt: the talker starts from the thinker's
whole output (it has no streaming twin). `talker2code2wav` hands the talker's codes to token2wav
(vllm-omni calls that stage code2wav); with `async_chunk` its twin `talker2code2wav_stream` hands
them over in chunks as the talker makes them, and token2wav speaks them as they come.
"""

from __future__ import annotations

import torch

from ...engines.base import StageInputs
from ..thinker_rows import StageInputError, merge_rows, thinker_legs
from .records import TalkerOutput, TalkerPrompt, ThinkerOutput, Token2WavPrompt

__all__ = ["StageInputError", "talker2code2wav", "talker2code2wav_stream", "thinker2talker"]


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
