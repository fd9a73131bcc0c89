"""What a request takes and gives besides its output: a prompt prepared ahead (`PreparedPrompt`),
the deltas of a streamed request (`TextDelta`, `AudioDelta`, `Finished`), and the errors it may
end with. `omni_pd.orchestrator.async_omni` exports them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Any

import torch

from ..engines.types import TokenPrompt
from .outputs import OmniRequestOutput
from .stage_client import StageError, StageUnavailable


class RequestAborted(RuntimeError):
    """The request was aborted (its client went away)."""


class RequestTimeout(StageError):
    """The request passed its deadline."""


class HandoffFailed(StageUnavailable):
    """The P/D pair could not hand the KV on and its kv_fallback is 'error'."""


class PromptTooLong(ValueError):
    """Prompt plus max_tokens exceed the text stage's context."""

    @classmethod
    def of(cls, prompt_len: int, max_tokens: int, context: int, at_least: bool = False) -> "PromptTooLong":
        return cls(
            f"the prompt has {'over ' if at_least else ''}{prompt_len} tokens and asks for up "
            f"to {max_tokens} more, over this model's context of {context} tokens; shorten "
            "the messages or lower max_tokens"
        )


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt normalized and built for the text stage (`AsyncOmni.prepare`): `generate` and
    `stream` take it as the prompt and skip building it again (the server builds it once, in the
    thread that checks its length)."""

    prompt: Any  # the model's normalized prompt (messages, speaker)
    text_prompt: TokenPrompt


@dataclass
class TextDelta:
    """Text that follows what was sent, and how many generated tokens it covers (0: text the
    detokenizer held back until the end)."""

    text: str
    tokens: int = 0


# Where a text stage's deltas go: (text, generated tokens it covers).
TextSink = Callable[[str, int], None]


@dataclass
class AudioDelta:
    """Waveform samples that follow the ones already sent for this request (float32, mono)."""

    audio: torch.Tensor
    sample_rate: int


@dataclass
class Finished:
    output: OmniRequestOutput
