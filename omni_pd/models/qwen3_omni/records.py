"""What Qwen3-Omni's stages exchange: the thinker's prompt and output (the generic records of
omni_pd/engines/types.py plus the rows the talker reads), the talker's input and codes, and
code2wav's input. One record per request per stage."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_pd.engines.types import TextOutput
from omni_pd.models.omni_prompt import AudioTokenPrompt


class ThinkerPrompt(AudioTokenPrompt):
    """A tokenised prompt, with audio features when the prompt has audio parts."""


@dataclass
class ThinkerOutput(TextOutput):
    """A thinker leg's result. Row i of `*_embeds` / `*_hidden` is absolute position
    `start + i` of the sequence prompt + output tokens."""

    # Layer 0 (the embedding output, audio features merged in) and the talker's accept layer.
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden]
    prompt_hidden: torch.Tensor | None = None
    output_embeds: torch.Tensor | None = None  # [n, hidden], rows for fed-back output tokens
    output_hidden: torch.Tensor | None = None
    output_start: int = 0  # absolute position of output_embeds[0]


@dataclass
class TalkerPrompt:
    """Everything the talker needs from the thinker, already merged across P/D legs."""

    request_id: str
    prompt_token_ids: list[int]  # the thinker's prompt
    output_token_ids: list[int]  # the thinker's generated tokens
    thinker_embeds: torch.Tensor  # [positions, hidden]: prompt then fed-back output tokens
    # The accept layer's hidden states: the talker reads them at prompt positions only, so a
    # streamed prompt (final=False) carries just those.
    thinker_hidden: torch.Tensor
    speaker: str = "ethan"
    # False: the thinker is still running; more tokens and rows follow as TalkerInputDelta.
    final: bool = True


@dataclass
class TalkerInputDelta:
    """What a running thinker added since the talker's prompt or the previous delta."""

    output_token_ids: list[int]
    thinker_embeds: torch.Tensor  # [n, hidden]: the next fed-back rows


@dataclass
class ThinkerChunk:
    """What a streamed thinker request produced in one step: new tokens and the rows of the
    tokens it fed back. A leg that prefilled sends its prompt rows in its first chunk."""

    token_ids: list[int]
    embeds: torch.Tensor  # [n, hidden]: rows for absolute positions start .. start + n - 1
    start: int
    prompt_token_ids: list[int] | None = None  # first chunk only
    prompt_embeds: torch.Tensor | None = None  # first chunk of a leg that prefilled
    prompt_hidden: torch.Tensor | None = None


@dataclass
class TalkerOutput:
    request_id: str
    codes: torch.Tensor  # [num_code_groups, frames], int64
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Code2WavPrompt:
    request_id: str
    codes: torch.Tensor  # [num_code_groups, frames]
    # False: more frames follow through the engine's `append_input` (streaming from the talker).
    final: bool = True
