"""A user's prompt (chat messages, plain text or token ids, with audio) as the omni models of
this package take it, and the chat-template prompt builder they share.

Each audio part becomes one audio placeholder token in the chat template; the builder computes
the clip's mel features (`WhisperFeatureExtractor`) and expands the placeholder to the number of
positions the model's audio encoder emits for it, as the models' own processors do. What differs
between models (the placeholder, the mel bins, the count, the prompt record) is passed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from transformers import WhisperFeatureExtractor

from omni_pd.audio_io import decode_audio
from omni_pd.engines.types import TokenPrompt

AUDIO_SAMPLE_RATE = 16_000


@dataclass
class AudioTokenPrompt(TokenPrompt):
    """A tokenised prompt, with audio features when the prompt has audio parts (an omni
    thinker's prompt record)."""

    input_features: torch.Tensor | None = None  # [num_audios, num_mel_bins, frames]
    feature_attention_mask: torch.Tensor | None = None  # [num_audios, frames]

    def has_multimodal_inputs(self) -> bool:
        return self.input_features is not None


@dataclass
class OmniPrompt:
    """One request's input, in any of the forms `Omni.generate` accepts."""

    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    audios: list[np.ndarray] = field(default_factory=list)  # 16 kHz mono float32, in order
    speaker: str | None = None  # None: the model's default voice


def normalize_prompt(prompt: Any, default_speaker: str) -> OmniPrompt:
    """Accept a str, a list of chat messages, a dict with `messages` / `prompt` /
    `prompt_token_ids` (and optional `audios`, `speaker`), or an `OmniPrompt`."""
    if isinstance(prompt, OmniPrompt):
        return prompt if prompt.speaker else dataclasses.replace(prompt, speaker=default_speaker)
    if isinstance(prompt, str):
        return OmniPrompt(messages=[{"role": "user", "content": prompt}], speaker=default_speaker)
    if isinstance(prompt, list):
        return OmniPrompt(messages=prompt, speaker=default_speaker)
    if isinstance(prompt, dict):
        allowed = {"messages", "prompt", "prompt_token_ids", "audios", "speaker"}
        unknown = set(prompt) - allowed
        if unknown:
            raise ValueError(f"unknown prompt key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        messages = prompt.get("messages")
        if messages is None and "prompt" in prompt:
            messages = [{"role": "user", "content": prompt["prompt"]}]
        if messages is None and prompt.get("prompt_token_ids") is None:
            raise ValueError("a prompt dict needs 'messages', 'prompt' or 'prompt_token_ids'")
        return OmniPrompt(
            messages=messages,
            prompt_token_ids=prompt.get("prompt_token_ids"),
            audios=list(prompt.get("audios", [])),
            speaker=prompt.get("speaker") or default_speaker,
        )
    raise TypeError(
        f"unsupported prompt type {type(prompt).__name__}: pass a str, a list of chat "
        "messages or a dict with 'messages' / 'prompt' / 'prompt_token_ids'"
    )


class AudioPromptBuilder:
    """Chat messages -> the model's prompt record (`make_prompt(prompt_token_ids=...,
    input_features=..., feature_attention_mask=...)`)."""

    def __init__(
        self,
        tokenizer,
        audio_token_id: int,
        num_mel_bins: int,
        token_count: Callable[[int], int],
        make_prompt: Callable[..., Any],
    ):
        self.tokenizer = tokenizer
        self.audio_token_id = audio_token_id
        self.token_count = token_count  # mel frames -> the encoder's positions
        self.make_prompt = make_prompt
        self.features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=AUDIO_SAMPLE_RATE)

    def _audio_from_parts(self, messages: list[dict[str, Any]]) -> list[np.ndarray]:
        found = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if part.get("type") == "input_audio":
                        spec = part["input_audio"]
                        found.append(decode_audio(spec["data"], spec.get("format"), AUDIO_SAMPLE_RATE))
                    elif part.get("type") == "audio":
                        if part.get("audio") is None:
                            raise ValueError(
                                "an audio part needs 'audio' (16 kHz mono float "
                                "samples); or send {'type': 'input_audio', "
                                "'input_audio': {'data': <base64 WAV>, 'format': 'wav'}}"
                            )
                        found.append(np.asarray(part["audio"], dtype=np.float32))
        return found

    def build(self, prompt: OmniPrompt) -> Any:
        if prompt.prompt_token_ids is not None:
            if prompt.audios:
                raise ValueError("audio needs chat messages, not raw prompt_token_ids")
            return self.make_prompt(prompt_token_ids=list(prompt.prompt_token_ids))
        if not prompt.messages:
            raise ValueError("the prompt has no messages")
        audios = prompt.audios or self._audio_from_parts(prompt.messages)
        ids = list(
            self.tokenizer.apply_chat_template(
                prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        placeholders = ids.count(self.audio_token_id)
        if placeholders != len(audios):
            raise ValueError(
                f"the messages have {placeholders} audio part(s) but {len(audios)} audio input(s) were given"
            )
        if not audios:
            return self.make_prompt(prompt_token_ids=ids)
        features, mask = self._clip_features(audios)
        counts = iter(self.token_count(int(n)) for n in mask.sum(-1))
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(counts) if token == self.audio_token_id else [token])
        return self.make_prompt(
            prompt_token_ids=expanded, input_features=features, feature_attention_mask=mask
        )

    def _clip_features(self, audios: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each clip's mel features computed alone, then zero-padded to the longest: a clip's
        frames do not depend on the other clips of the prompt (padded together, the STFT of a
        shorter clip's last frames would see the padding), so a clip that comes back in a later
        turn has the same features and the prefix cache can reuse its blocks."""
        clips = [
            self.features(
                audio,
                sampling_rate=AUDIO_SAMPLE_RATE,
                return_attention_mask=True,
                return_tensors="pt",
                padding="longest",
            )
            for audio in audios
        ]
        frames = max(clip["input_features"].shape[-1] for clip in clips)
        features = torch.zeros((len(clips), clips[0]["input_features"].shape[1], frames))
        mask = torch.zeros((len(clips), frames), dtype=torch.long)
        for i, clip in enumerate(clips):
            n = clip["input_features"].shape[-1]
            features[i, :, :n] = clip["input_features"][0].to(torch.float32)
            mask[i, :n] = clip["attention_mask"][0].to(torch.long)
        return features, mask


@dataclass(frozen=True)
class AudioClip:
    """One audio input of a prompt: its placeholder positions and what it is."""

    index: int  # its row of input_features
    start: int  # its first placeholder position in the prompt
    length: int  # its placeholder positions (what the audio encoder emits for it)
    key: bytes  # xxh3-128 of the mel features the encoder reads: the prefix cache's extra key

    @property
    def end(self) -> int:
        return self.start + self.length


def audio_clips(prompt: Any, audio_token_id: int, token_count: Callable[[int], int]) -> list[AudioClip]:
    """The prompt's (an `AudioTokenPrompt`) audio inputs in order, each placed on its run of
    placeholder positions (the i-th input takes the next `token_count(frames)` placeholders, as
    the processor expanded them)."""
    if prompt.input_features is None:
        return []
    placeholders = [i for i, t in enumerate(prompt.prompt_token_ids) if t == audio_token_id]
    clips, taken = [], 0
    for index, frames in enumerate(prompt.feature_attention_mask.sum(-1).tolist()):
        length = token_count(int(frames))
        span = placeholders[taken : taken + length]
        if len(span) != length or span[-1] - span[0] != length - 1:
            raise ValueError(
                f"audio input {index} needs {length} consecutive placeholder "
                f"positions; the prompt has {len(placeholders)} placeholders in all"
            )
        features = np.ascontiguousarray(prompt.input_features[index, :, : int(frames)].cpu().numpy())
        digest = xxhash.xxh3_128(np.asarray(features.shape, dtype="<i8").tobytes())
        digest.update(features.astype("<f4", copy=False).tobytes())
        clips.append(AudioClip(index, span[0], length, digest.digest()))
        taken += length
    if taken != len(placeholders):
        raise ValueError(
            f"the prompt has {len(placeholders)} audio placeholders, its "
            f"{len(clips)} audio input(s) fill {taken}"
        )
    return clips


def vllm_audio_prompt(prompt: Any, audio_token_id: int) -> dict[str, Any]:
    """An omni thinker's prompt (an `AudioTokenPrompt`) as vLLM's Qwen omni thinkers take it: the
    token ids, and for audio the builder's features as precomputed items (vLLM runs its own audio
    tower on exactly these) with each clip's run of placeholders folded back to one, which vLLM
    expands again from the features' lengths (its rows come back on the builder's positions, or
    the hooks find them missing)."""
    ids = list(prompt.prompt_token_ids)
    if getattr(prompt, "input_features", None) is None:
        return {"prompt_token_ids": ids}
    lengths = prompt.feature_attention_mask.sum(-1)
    features = torch.cat([prompt.input_features[i, :, : int(n)] for i, n in enumerate(lengths)], dim=1)
    folded = [t for i, t in enumerate(ids) if t != audio_token_id or i == 0 or ids[i - 1] != audio_token_id]
    return {
        "prompt_token_ids": folded,
        "multi_modal_data": {
            "audio": {
                "input_audio_features": features,
                "audio_feature_lengths": lengths.to(torch.long),
                "feature_attention_mask": prompt.feature_attention_mask,
            }
        },
    }


def encode_clip(thinker: Any, prompt: Any, clip: AudioClip, dtype: torch.dtype) -> torch.Tensor:
    """One audio input encoded alone by `thinker`'s audio tower (transformers'
    `get_audio_features`), [clip.length, hidden]: its rows do not depend on the prompt's other
    inputs. ValueError if the encoder's row count is not the placeholders' count."""
    i = clip.index
    encoded = thinker.get_audio_features(
        prompt.input_features[i : i + 1], prompt.feature_attention_mask[i : i + 1], return_dict=True
    ).last_hidden_state.to(dtype)
    if encoded.shape[0] != clip.length:
        raise ValueError(
            f"audio input {i}: the encoder gave {encoded.shape[0]} rows for {clip.length} placeholders"
        )
    return encoded
