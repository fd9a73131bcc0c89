"""Stage input processors for Qwen3-Omni, named in stage YAMLs by `custom_process_input_func`.

They know Qwen3-Omni's data, not processes or engines: `thinker2talker` merges the thinker's
prompt embeddings with its generated-token embeddings (from one colocated thinker, or from the
prefill and decode legs of a P/D pair) and `talker2code2wav` bounds the codec codes.
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


def talker2code2wav(inputs: StageInputs) -> Code2WavPrompt:
    sources = [inputs.upstream[s] for s in inputs.source_stage_ids]
    talker_outputs = [o for o in sources if isinstance(o, TalkerOutput)]
    if len(talker_outputs) != 1:
        raise StageInputError(f"request {inputs.request_id}: stage {inputs.stage_id} needs one talker "
                              f"output among its sources {inputs.source_stage_ids}")
    codes = talker_outputs[0].codes
    c2w = inputs.model_config.code2wav_config
    if codes.dim() != 2 or codes.shape[0] != c2w.num_quantizers:
        raise StageInputError(f"request {inputs.request_id}: codes have shape {tuple(codes.shape)}, "
                              f"code2wav takes [{c2w.num_quantizers}, frames]")
    frames = codes.shape[1]
    # A frame with an id outside the codebook (an end-of-speech or control code) ends the speech.
    invalid = ((codes < 0) | (codes >= c2w.codebook_size)).any(dim=0).nonzero()
    keep = int(invalid[0]) if len(invalid) else frames
    keep = min(keep, c2w.max_position_embeddings)
    if keep < frames:
        log.warning("request %s: code2wav takes %d of %d codec frames (ids must be below %d, at most "
                    "%d frames); the rest is dropped", inputs.request_id, keep, frames,
                    c2w.codebook_size, c2w.max_position_embeddings)
    return Code2WavPrompt(request_id=inputs.request_id, codes=codes[:, :keep].contiguous())
