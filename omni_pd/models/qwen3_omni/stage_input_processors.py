"""Stage input processors for Qwen3-Omni, named in stage YAMLs by `custom_process_input_func`.

They know Qwen3-Omni's data, not processes or engines: `thinker2talker` merges the thinker's
prompt embeddings with its generated-token embeddings (from one colocated thinker, or from the
prefill and decode legs of a P/D pair) and `talker2code2wav` bounds the codec codes.

A processor `X` may have a streaming counterpart `X_stream`: called with the same StageInputs
when the upstream stage starts (the pipeline's `async_chunk`), it gives the downstream stage's
opening prompt and turns each upstream chunk into input for it, yielding in total exactly what
`X` would give from the whole upstream output.
"""
from __future__ import annotations

import logging

import torch

from ...engines.base import StageInputs
from ...engines.types import Code2WavPrompt, TalkerOutput, TalkerPrompt, ThinkerOutput

log = logging.getLogger(__name__)


class StageInputError(ValueError):
    """Upstream outputs that cannot make a valid input for the next stage."""


def _merge_rows(request_id: str, name: str, prompt_rows: torch.Tensor, output_rows: torch.Tensor,
                output_start: int, prompt_len: int, expected: int) -> torch.Tensor:
    if prompt_rows.shape[0] < output_start:
        raise StageInputError(
            f"request {request_id}: the prompt {name} cover {prompt_rows.shape[0]} positions but the "
            f"generated-token {name} start at position {output_start} (prompt length {prompt_len})")
    if prompt_rows.shape[1:] != output_rows.shape[1:]:
        raise StageInputError(
            f"request {request_id}: prompt {name} have shape {tuple(prompt_rows.shape)} but "
            f"generated-token {name} have {tuple(output_rows.shape)}")
    # Rows the decode leg recomputed (a decode engine may re-run the last prompt position) replace
    # the prefill leg's copy of the same positions.
    merged = torch.cat([prompt_rows[:output_start], output_rows], dim=0)
    if merged.shape[0] != expected:
        raise StageInputError(
            f"request {request_id}: merged {name} cover {merged.shape[0]} positions, expected "
            f"{expected} (prompt {prompt_len} + generated tokens fed back); prompt rows "
            f"{prompt_rows.shape[0]}, generated rows {output_rows.shape[0]} from position {output_start}")
    return merged


def thinker2talker(inputs: StageInputs) -> TalkerPrompt:
    thinker_outputs = [o for o in inputs.upstream.values() if isinstance(o, ThinkerOutput)]
    with_prompt = [o for o in thinker_outputs if o.prompt_embeds is not None]
    with_output = [o for o in thinker_outputs if o.output_embeds is not None]
    if len(with_prompt) != 1 or len(with_output) != 1:
        raise StageInputError(
            f"request {inputs.request_id}: stage {inputs.stage_id} needs exactly one thinker output "
            f"with prompt embeddings and one with generated-token embeddings; got "
            f"{len(with_prompt)} and {len(with_output)} from stages {sorted(inputs.upstream)}")
    prompt_out, gen_out = with_prompt[0], with_output[0]
    if prompt_out.prompt_token_ids != gen_out.prompt_token_ids:
        raise StageInputError(
            f"request {inputs.request_id}: the prefill leg saw a {len(prompt_out.prompt_token_ids)}-token "
            f"prompt, the decode leg a {len(gen_out.prompt_token_ids)}-token one; they must be the same")
    prompt_len = len(gen_out.prompt_token_ids)
    # Every generated token but the last was fed back through the thinker.
    expected = prompt_len + max(len(gen_out.token_ids) - 1, 0)
    embeds = _merge_rows(inputs.request_id, "embeddings", prompt_out.prompt_embeds,
                         gen_out.output_embeds, gen_out.output_start, prompt_len, expected)
    hidden = _merge_rows(inputs.request_id, "hidden states", prompt_out.prompt_hidden,
                         gen_out.output_hidden, gen_out.output_start, prompt_len, expected)
    return TalkerPrompt(request_id=inputs.request_id, prompt_token_ids=list(gen_out.prompt_token_ids),
                        output_token_ids=list(gen_out.token_ids), thinker_embeds=embeds,
                        thinker_hidden=hidden, speaker=inputs.speaker)


def _speech_frames(request_id: str, codes: torch.Tensor, c2w, already: int) -> tuple[int, bool]:
    """How many leading frames of `codes` are speech, given `already` frames were taken before,
    and whether the speech ends inside `codes`. A frame with an id outside the codebook (an
    end-of-speech or control code) ends the speech; so does code2wav's position limit."""
    if codes.dim() != 2 or codes.shape[0] != c2w.num_quantizers:
        raise StageInputError(f"request {request_id}: codes have shape {tuple(codes.shape)}, "
                              f"code2wav takes [{c2w.num_quantizers}, frames]")
    frames = codes.shape[1]
    invalid = ((codes < 0) | (codes >= c2w.codebook_size)).any(dim=0).nonzero()
    keep = int(invalid[0]) if len(invalid) else frames
    keep = max(min(keep, c2w.max_position_embeddings - already), 0)
    return keep, keep < frames


def _log_dropped(request_id: str, kept: int, frames: int, c2w) -> None:
    log.warning("request %s: code2wav takes %d of %d codec frames (ids must be below %d, at most "
                "%d frames); the rest is dropped", request_id, kept, frames, c2w.codebook_size,
                c2w.max_position_embeddings)


def _talker_output(inputs: StageInputs) -> TalkerOutput:
    sources = [inputs.upstream[s] for s in inputs.source_stage_ids if s in inputs.upstream]
    talker_outputs = [o for o in sources if isinstance(o, TalkerOutput)]
    if len(talker_outputs) != 1:
        raise StageInputError(f"request {inputs.request_id}: stage {inputs.stage_id} needs one talker "
                              f"output among its sources {inputs.source_stage_ids}")
    return talker_outputs[0]


def talker2code2wav(inputs: StageInputs) -> Code2WavPrompt:
    codes = _talker_output(inputs).codes
    c2w = inputs.model_config.code2wav_config
    keep, ended = _speech_frames(inputs.request_id, codes, c2w, 0)
    if ended:
        _log_dropped(inputs.request_id, keep, codes.shape[1], c2w)
    return Code2WavPrompt(request_id=inputs.request_id, codes=codes[:, :keep].contiguous())


class talker2code2wav_stream:  # noqa: N801 - named after the processor it streams
    """`talker2code2wav` for a talker that streams its frames: code2wav opens with no frames and
    gets each chunk's speech frames as they come, the same frames `talker2code2wav` keeps."""

    def __init__(self, inputs: StageInputs):
        self.request_id = inputs.request_id
        self.c2w = inputs.model_config.code2wav_config
        self.taken = 0  # frames passed on
        self.seen = 0  # frames received
        self.ended = False

    def prompt(self) -> Code2WavPrompt:
        return Code2WavPrompt(request_id=self.request_id,
                              codes=torch.zeros((self.c2w.num_quantizers, 0), dtype=torch.long),
                              final=False)

    def feed(self, codes: torch.Tensor) -> torch.Tensor | None:
        """The speech frames in a chunk of talker codes (None when there are none)."""
        self.seen += codes.shape[1] if codes.dim() == 2 else 0
        if self.ended:
            return None
        keep, self.ended = _speech_frames(self.request_id, codes, self.c2w, self.taken)
        self.taken += keep
        return codes[:, :keep].contiguous() if keep else None

    def close(self, output: TalkerOutput) -> torch.Tensor:
        """The talker finished: check its chunks were its whole output; code2wav's last input
        (no frames: they all came as chunks)."""
        if self.seen != output.codes.shape[1]:
            raise StageInputError(f"request {self.request_id}: the talker streamed {self.seen} "
                                  f"frames but its output has {output.codes.shape[1]}")
        if self.taken < self.seen:
            _log_dropped(self.request_id, self.taken, self.seen, self.c2w)
        return torch.zeros((self.c2w.num_quantizers, 0), dtype=torch.long)
