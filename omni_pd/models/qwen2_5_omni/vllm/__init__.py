"""Qwen2.5-Omni's thinker on vLLM: a subclass of vLLM's own thinker that records what the talker
needs (thinker.py), and the hooks that turn those rows into the thinker's records (hooks.py).
This module imports no vLLM: the registry reads the names below without it."""

# The checkpoint's architecture, and the class that vLLM's ModelRegistry then builds for it.
ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
MODEL_CLASS = "omni_pd.models.qwen2_5_omni.vllm.thinker:RowRecordingThinker"
