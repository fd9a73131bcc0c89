"""Qwen3-Omni-MoE as the orchestrator sees it (`omni_pd.registry.ModelPipeline`)."""

from __future__ import annotations

import math

from omni_pd.registry import ModelPipeline

from .factory import load_config, load_tokenizer, resolve_model
from .prompt import PromptBuilder, normalize_prompt


def thinker_eos_ids(model_config, tokenizer) -> frozenset[int]:
    """The thinker's text ends at <|im_end|> (and the tokenizer's EOS, where it has one)."""
    ids = {model_config.im_end_token_id}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def qwen3_omni_pipeline(model: str) -> ModelPipeline:
    source = resolve_model(model)
    config = load_config(source)
    tokenizer = load_tokenizer(source)
    builder = PromptBuilder(tokenizer, config.thinker_config)
    return ModelPipeline(
        name=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=thinker_eos_ids(config, tokenizer),
        context_len=config.thinker_config.text_config.max_position_embeddings,
        voices=tuple(sorted(config.talker_config.speaker_id or {})),
        normalize_prompt=normalize_prompt,
        build_prompt=builder.build,
        speaks=speaks,
        speech_text=SpeechText(tokenizer, config.code2wav_config),
    )


class SpeechText:
    """The talker speaks the answer one text token per codec frame (it is fed the assistant's
    text one position per step), and code2wav makes `samples_per_frame` samples of each frame at
    24 kHz (12.5 frames a second in the real model): so `seconds` of speech say the answer's
    first `seconds * 12.5` tokens."""

    SAMPLE_RATE = 24_000

    def __init__(self, tokenizer, code2wav_config):
        self.tokenizer = tokenizer
        rates = list(code2wav_config.upsampling_ratios) + list(code2wav_config.upsample_rates)
        self.frames_per_s = self.SAMPLE_RATE / math.prod(rates)

    def __call__(self, text: str, seconds: float) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        heard = ids[: max(0, int(seconds * self.frames_per_s))]
        return self.tokenizer.decode(heard, skip_special_tokens=True) if heard else ""


def speaks(output) -> bool:
    """The talker starts from the thinker's row of the first generated token, which exists once
    a second token is generated: an answer of one token (its end token, or max_tokens 1) has no
    speech."""
    return len(output.token_ids) >= 2
