"""Qwen2.5-Omni as the orchestrator sees it (`omni_pd.registry.ModelPipeline`)."""

from __future__ import annotations

from omni_pd.registry import ModelPipeline

from .factory import load_config, load_tokenizer, resolve_model
from .prompt import PromptBuilder, normalize_prompt
from .tiny_config import VOICES


def thinker_eos_ids(tokenizer) -> frozenset[int]:
    """The thinker's text ends at <|im_end|> or <|endoftext|> (its generation config's)."""
    ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)


def qwen2_5_omni_pipeline(model: str) -> ModelPipeline:
    source = resolve_model(model)
    config = load_config(source)
    tokenizer = load_tokenizer(source)
    return ModelPipeline(
        name=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=thinker_eos_ids(tokenizer),
        context_len=config.thinker_config.text_config.max_position_embeddings,
        voices=tuple(v.lower() for v in VOICES),  # the server matches voices lower-cased
        normalize_prompt=normalize_prompt,
        build_prompt=PromptBuilder(tokenizer, config.thinker_config).build,
        speaks=speaks,
        dummy_weights_audio_gain=1.0,  # its tiny vocoder is scaled to be heard (factory.py)
    )


def speaks(output) -> bool:
    """The talker starts from the thinker's row of the first generated token, fed back at the
    second step: an answer of one token (only its end) has nothing to speak."""
    return len(output.token_ids) >= 2
