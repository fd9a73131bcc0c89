"""Moved to `omni_pd.kv.vllm.block_hash` (issue 46: vLLM interop in one package). This alias is
kept only for `engines/hf/prefix_cache.py`, which another branch of issue 46 is moving now;
delete it once that move lands and imports `kv.vllm.block_hash` itself."""

from .vllm.block_hash import CRYPTOGRAPHIC_ALGOS, SUPPORTED_ALGOS, VllmBlockHasher

__all__ = ["CRYPTOGRAPHIC_ALGOS", "SUPPORTED_ALGOS", "VllmBlockHasher"]
