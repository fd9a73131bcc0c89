"""Qwen3-Omni-MoE as the orchestrator sees it (`omni_pd.registry.ModelPipeline`)."""
from __future__ import annotations

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
        name=model, config=config, tokenizer=tokenizer,
        eos_token_ids=thinker_eos_ids(config, tokenizer),
        context_len=config.thinker_config.text_config.max_position_embeddings,
        voices=tuple(sorted(config.talker_config.speaker_id or {})),
        normalize_prompt=normalize_prompt, build_prompt=builder.build, speaks=speaks)


def speaks(output) -> bool:
    """The talker starts from the thinker's row of the first generated token, which exists once
    a second token is generated: an answer of one token (its end token, or max_tokens 1) has no
    speech."""
    return len(output.token_ids) >= 2
