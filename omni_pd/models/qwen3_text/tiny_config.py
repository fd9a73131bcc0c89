"""The embedded tiny text-only Qwen3 that vLLM stages run on CPU: `tiny-qwen3-text`.

vLLM cannot run the Qwen3-Omni thinker on a CPU-only machine (its model files import
torchvision), so a `Qwen3ForCausalLM` with the tiny Qwen3-Omni's text vocabulary stands in for it:
the byte-level tokenizer of `omni_pd.models.qwen3_omni.tokenizer` (272 ids) fits, so the
orchestrator's prompt builder and a vLLM engine agree on every token id.

vLLM needs a model directory, so `ensure_tiny_text_model()` writes `config.json`, the tokenizer
and seeded random weights (`model.safetensors`) into a cache directory keyed by a hash of their
contents. Weights are saved (rather than vLLM's `load_format: dummy`) so that every engine -- a
prefill engine and a decode engine in different processes -- loads bit-identical weights with a
realistic scale (vLLM's dummy weights are uniform in +-1e-3, which makes greedy outputs nearly
independent of the prompt and a negative control meaningless). `load_format: dummy` still works.

head_dim is 32: vLLM's CPU attention supports head sizes {32, 64, 80, 96, ...}.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoint_cache import cached_checkpoint, content_key

TINY_TEXT_MODEL_NAME = "tiny-qwen3-text"
DEFAULT_SEED = 0
_FORMAT_VERSION = 1  # bump when the files written below change shape


def tiny_text_config_dict() -> dict[str, Any]:
    from ..qwen3_omni.tiny_config import SPECIAL_TOKENS, TEXT_VOCAB_SIZE

    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.5,
        "use_sliding_window": False,
        "bos_token_id": SPECIAL_TOKENS["<|endoftext|>"],
        "eos_token_id": SPECIAL_TOKENS["<|im_end|>"],
        "pad_token_id": SPECIAL_TOKENS["<|endoftext|>"],
        "torch_dtype": "float32",
    }


def _write_model(directory: Path, config: dict[str, Any], seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..qwen3_omni.tokenizer import build_tiny_tokenizer

    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures",)})
    hf_config.architectures = config["architectures"]
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(hf_config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)


def ensure_tiny_text_model(seed: int = DEFAULT_SEED, cache_root: str | os.PathLike | None = None) -> Path:
    """The directory holding the tiny text model (built on first use, once per machine)."""
    config = tiny_text_config_dict()
    key = content_key({"config": config, "seed": seed, "v": _FORMAT_VERSION})
    return cached_checkpoint(
        TINY_TEXT_MODEL_NAME, key, lambda directory: _write_model(directory, config, seed), cache_root
    )
