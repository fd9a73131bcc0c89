"""What flows between stages, as far as the layers that know no model read it: a tokenised
prompt, a text stage's output, an audio stage's output. A model package subclasses these with
what its own stages exchange (omni_pd/models/<model>/records.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TokenPrompt:
    """A tokenised prompt for a text stage; a model's subclass adds its multimodal inputs."""

    prompt_token_ids: list[int]

    def tokens_only(self) -> "TokenPrompt":
        """The same prompt without its multimodal inputs: a decode leg whose prompt KV comes
        from its prefill leg needs only the ids."""
        return type(self)(prompt_token_ids=list(self.prompt_token_ids))

    def has_multimodal_inputs(self) -> bool:
        """Whether the prompt carries more than token ids (audio features, images)."""
        return False


@dataclass
class TextOutput:
    """A text stage's result (one leg's, in P/D)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a remote prefill
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AudioOutput:
    request_id: str
    audio: torch.Tensor  # [samples], float32
    sample_rate: int
    metrics: dict[str, float] = field(default_factory=dict)
    # The final output of a streamed request: its samples all left as chunks, so `audio` is
    # empty here and the receiver joins the chunks (the whole waveform again doubled what a
    # streamed request sent from code2wav).
    samples_in_chunks: bool = False
