"""What Qwen2.5-Omni's stages exchange: the thinker's prompt and output (the generic records of
omni_pd/engines/types.py plus the rows the talker reads), the talker's input and codes, and
token2wav's input. One record per request per stage.

The talker reads one row per thinker position: the thinker's last hidden state (after its final
norm) plus the position's token embedding, the embedding zeroed where the prompt holds audio
(transformers' `generate` masks it there). The thinker sends that sum, once, instead of two rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_pd.engines.types import TextOutput
from omni_pd.models.omni_prompt import AudioTokenPrompt


class ThinkerPrompt(AudioTokenPrompt):
    """A tokenised prompt, with audio features when the prompt has audio parts."""


@dataclass
class ThinkerOutput(TextOutput):
    """A thinker leg's result. Row i of `output_rows` is absolute position `output_start + i`
    of the sequence prompt + output tokens (the rows of fed-back output tokens)."""

    prompt_rows: torch.Tensor | None = None  # [prompt_len, hidden]: the talker's input rows
    output_rows: torch.Tensor | None = None  # [n, hidden]
    output_start: int = 0


@dataclass
class ThinkerChunk:
    """What a streamed thinker request produced in one step: new tokens and the rows of the
    tokens it fed back. A leg that prefilled sends its prompt rows in its first chunk."""

    token_ids: list[int]
    rows: torch.Tensor  # [n, hidden]: absolute positions start .. start + n - 1
    start: int
    prompt_token_ids: list[int] | None = None  # first chunk only
    prompt_rows: torch.Tensor | None = None  # first chunk of a leg that prefilled


@dataclass
class TalkerPrompt:
    """Everything the talker needs from the thinker, merged across P/D legs."""

    request_id: str
    prompt_token_ids: list[int]  # the thinker's prompt
    output_token_ids: list[int]  # the thinker's generated tokens
    rows: torch.Tensor  # [positions, hidden]: prompt, then fed-back output tokens
    speaker: str = "Chelsie"
    final: bool = True  # False: the thinker still runs; TalkerInputDelta follow


@dataclass
class TalkerInputDelta:
    output_token_ids: list[int]
    rows: torch.Tensor  # [n, hidden]: the next fed-back rows


@dataclass
class TalkerOutput:
    request_id: str
    codes: torch.Tensor  # [frames], int64: one codebook
    metrics: dict[str, float] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [steps, vocab]: each step's raw logits (a tracing runner's)


@dataclass
class Token2WavPrompt:
    request_id: str
    codes: torch.Tensor  # [frames]
    speaker: str = "Chelsie"
    final: bool = True  # False: more codes follow through the engine's `append_input`
