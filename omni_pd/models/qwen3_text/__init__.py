"""A tiny text-only Qwen3 (`Qwen3ForCausalLM`) for vLLM stages on CPU."""

from .tiny_config import TINY_TEXT_MODEL_NAME, ensure_tiny_text_model, tiny_text_config_dict

__all__ = ["TINY_TEXT_MODEL_NAME", "ensure_tiny_text_model", "tiny_text_config_dict"]
