"""What an omni model's talker reads of its thinker, merged across a P/D pair: the prefill leg's
rows of the prompt positions and the decode leg's rows of the fed-back tokens, checked."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class StageInputError(ValueError):
    """Upstream outputs that cannot make a valid input for the next stage."""


def merge_rows(
    request_id: str,
    name: str,
    prompt_rows: torch.Tensor,
    output_rows: torch.Tensor,
    output_start: int,
    prompt_len: int,
    expected: int,
) -> torch.Tensor:
    if prompt_rows.shape[0] < output_start:
        raise StageInputError(
            f"request {request_id}: the prompt {name} cover {prompt_rows.shape[0]} positions but the "
            f"generated-token {name} start at position {output_start} (prompt length {prompt_len})"
        )
    if prompt_rows.shape[1:] != output_rows.shape[1:]:
        raise StageInputError(
            f"request {request_id}: prompt {name} have shape {tuple(prompt_rows.shape)} but "
            f"generated-token {name} have {tuple(output_rows.shape)}"
        )
    # Rows the decode leg recomputed (a decode engine may re-run the last prompt position) replace
    # the prefill leg's copy of the same positions.
    merged = torch.cat([prompt_rows[:output_start], output_rows], dim=0)
    if merged.shape[0] != expected:
        raise StageInputError(
            f"request {request_id}: merged {name} cover {merged.shape[0]} positions, expected "
            f"{expected} (prompt {prompt_len} + generated tokens fed back); prompt rows "
            f"{prompt_rows.shape[0]}, generated rows {output_rows.shape[0]} from position {output_start}"
        )
    return merged


def thinker_legs(inputs: Any, output_type: type, prompt_rows: str, output_rows: str) -> tuple[Any, Any]:
    """(the thinker output holding the prompt's rows, the one holding the generated tokens'):
    one thinker's output twice, or a P/D pair's prefill and decode legs. `inputs` is the
    request's StageInputs; `prompt_rows` / `output_rows` name the records' row fields."""
    outputs = [o for o in inputs.upstream.values() if isinstance(o, output_type)]
    with_prompt = [o for o in outputs if getattr(o, prompt_rows) is not None]
    with_output = [o for o in outputs if getattr(o, output_rows) is not None]
    if len(with_prompt) != 1 or len(with_output) != 1:
        raise StageInputError(
            f"request {inputs.request_id}: stage {inputs.stage_id} needs exactly one thinker output "
            f"with {prompt_rows} and one with {output_rows}; got {len(with_prompt)} and "
            f"{len(with_output)} from stages {sorted(inputs.upstream)}"
        )
    prompt_out, gen_out = with_prompt[0], with_output[0]
    if prompt_out.prompt_token_ids != gen_out.prompt_token_ids:
        raise StageInputError(
            f"request {inputs.request_id}: the prefill leg saw a {len(prompt_out.prompt_token_ids)}-token "
            f"prompt, the decode leg a {len(gen_out.prompt_token_ids)}-token one; they must be the same"
        )
    return prompt_out, gen_out


def check_streamed(request_id: str, streamed: list[int], output: Any) -> None:
    """A streaming processor's close: the tokens the thinker streamed must be its whole output."""
    if streamed != list(output.token_ids):
        raise StageInputError(
            f"request {request_id}: the thinker streamed {len(streamed)} tokens but its output has "
            f"{len(output.token_ids)}"
        )


def with_whole_output(inputs: Any, output: Any) -> Any:
    """The request's StageInputs with the thinker's finished `output` as its source's: what a
    streaming processor hands the whole-output processor when the thinker finished before the
    next stage could start."""
    upstream = dict(inputs.upstream)
    upstream[max(inputs.source_stage_ids)] = output
    return dataclasses.replace(inputs, upstream=upstream)
