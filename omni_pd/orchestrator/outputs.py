"""What `Omni.generate` returns per request."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OmniRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the thinker's generated tokens
    text: str
    finish_reason: str
    audio: torch.Tensor | None  # float32 samples at `sample_rate`
    sample_rate: int | None
    metrics: dict[str, Any] = field(default_factory=dict)
    # Every stage's output record, when the Omni was made with keep_stage_outputs=True.
    stage_outputs: dict[int, Any] | None = None

    @property
    def audio_sha256(self) -> str | None:
        if self.audio is None:
            return None
        return hashlib.sha256(self.audio.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
