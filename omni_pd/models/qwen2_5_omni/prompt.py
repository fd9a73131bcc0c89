"""Turn a user's prompt into a Qwen2.5-Omni `ThinkerPrompt` (models/omni_prompt.py does the work):
each audio's single `<|AUDIO|>` from the chat template is expanded to the positions the
Qwen2.5-Omni audio encoder emits for the clip, as its processor does."""

from __future__ import annotations

from typing import Any

from omni_pd.models.omni_prompt import AudioPromptBuilder, OmniPrompt
from omni_pd.models.omni_prompt import normalize_prompt as _normalize

from .records import ThinkerPrompt
from .tiny_config import DEFAULT_VOICE


def audio_token_count(feature_frames: int) -> int:
    """Positions the Qwen2.5-Omni audio encoder emits for `feature_frames` mel frames (two
    stride-2 stages: the convolution's, then the pooling's)."""
    after_conv = (feature_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def normalize_prompt(prompt: Any) -> OmniPrompt:
    return _normalize(prompt, DEFAULT_VOICE)


class PromptBuilder(AudioPromptBuilder):
    def __init__(self, tokenizer, thinker_config):
        super().__init__(
            tokenizer,
            thinker_config.audio_token_index,
            thinker_config.audio_config.num_mel_bins,
            audio_token_count,
            ThinkerPrompt,
        )
