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

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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


def default_cache_root() -> Path:
    root = os.environ.get("OMNI_PD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omni-pd"


def _key(config: dict[str, Any], seed: int) -> str:
    blob = json.dumps({"config": config, "seed": seed, "v": _FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    (directory / "omni_pd_model.json").write_text(
        json.dumps({"name": TINY_TEXT_MODEL_NAME, "seed": seed, "format": _FORMAT_VERSION}))


def ensure_tiny_text_model(seed: int = DEFAULT_SEED, cache_root: str | os.PathLike | None = None) -> Path:
    """The directory holding the tiny text model (built on first use; safe when several
    processes ask at once: each builds into a private temporary directory and renames it)."""
    config = tiny_text_config_dict()
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"{TINY_TEXT_MODEL_NAME}-{_key(config, seed)}"
    if (target / "omni_pd_model.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        _write_model(scratch, config, seed)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "omni_pd_model.json").is_file():
                raise  # not a lost race: a real error
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target
