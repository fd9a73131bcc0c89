"""Turn a user's prompt (chat messages, plain text or token ids) into a Qwen3-Omni `ThinkerPrompt`
(models/omni_prompt.py does the work): each audio's single `<|audio_pad|>` from the chat template
is expanded to the number of positions the Qwen3-Omni audio encoder produces for it, as its
processor does.
"""

from __future__ import annotations

from typing import Any

from omni_pd.models.omni_prompt import AUDIO_SAMPLE_RATE, AudioPromptBuilder, OmniPrompt
from omni_pd.models.omni_prompt import normalize_prompt as _normalize
from omni_pd.models.qwen3_omni.records import ThinkerPrompt

__all__ = ["AUDIO_SAMPLE_RATE", "OmniPrompt", "PromptBuilder", "audio_token_count", "normalize_prompt"]

DEFAULT_VOICE = "ethan"


def audio_token_count(feature_frames: int, n_window: int = 50) -> int:
    """Positions the Qwen3-Omni audio encoder emits for `feature_frames` mel frames."""
    chunk = n_window * 2
    leftover = feature_frames % chunk
    lengths = (leftover - 1) // 2 + 1
    return ((lengths - 1) // 2 + 1 - 1) // 2 + 1 + (feature_frames // chunk) * 13


def normalize_prompt(prompt: Any) -> OmniPrompt:
    return _normalize(prompt, DEFAULT_VOICE)


class PromptBuilder(AudioPromptBuilder):
    def __init__(self, tokenizer, thinker_config):
        n_window = thinker_config.audio_config.n_window
        super().__init__(
            tokenizer,
            thinker_config.audio_token_id,
            thinker_config.audio_config.num_mel_bins,
            lambda frames: audio_token_count(frames, n_window),
            ThinkerPrompt,
        )
        self.n_window = n_window
