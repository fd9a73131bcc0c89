"""What an unmodified vLLM prefill engine tells a non-vLLM decode engine about its KV, and the
check the decode side makes at the first handoff.

omni-pd's vLLM engine adds one entry to a prefill leg's kv_transfer_params, `omni_pd_vllm_kv`
(`VllmProducerInfo.to_dict`): the KV geometry its MooncakeConnector registered (layer names and
indices, block size, KV heads, head size, dtype, CPU attention kernel, layout), its
`prefix_caching_hash_algo` and where its NONE_HASH seed comes from, and the model. The same dict
is the producer's fingerprint, logged once at INFO; the hf decode side logs its own in the same
shape (`consumer_fingerprint`), so an operator can diff the two lines.

`check_consumer` refuses, before any byte moves, a producer whose blocks this decode engine
cannot take exactly or cannot name by the same keys: one message naming every field that
differs with both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import KVIncompatibleError
from .layout import BlockLayout
from .vllm_layout import VLLM_CPU_LAYOUT, VllmKVGeometry, check_geometry

VLLM_KV_KEY = "omni_pd_vllm_kv"  # the prefill leg's kv_transfer_params entry


@dataclass(frozen=True)
class VllmProducerInfo:
    geometry: VllmKVGeometry
    hash_algo: str  # vLLM's prefix_caching_hash_algo
    seed_rule: str  # where its NONE_HASH seed comes from, as prefix_cache.naming_for words it
    model: str

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.geometry.to_dict(),
            "prefix_caching_hash_algo": self.hash_algo,
            "none_hash_seed": self.seed_rule,
            "model": self.model,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "VllmProducerInfo":
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_params[{VLLM_KV_KEY!r}] must be a mapping, got {data!r:.80}")
        try:
            return cls(
                VllmKVGeometry.from_dict(data),
                str(data["prefix_caching_hash_algo"]),
                str(data["none_hash_seed"]),
                str(data["model"]),
            )
        except KeyError as exc:
            raise ValueError(
                f"kv_transfer_params[{VLLM_KV_KEY!r}] lacks {exc}: the prefill engine is not "
                "omni-pd's vLLM engine of this version"
            ) from None


def seed_rule(algo: str, pythonhashseed: str | None) -> str:
    """The NONE_HASH seed rule of vLLM 0.32 for `algo`, worded as the hf naming words it."""
    if pythonhashseed is not None:
        return f"PYTHONHASHSEED={pythonhashseed!r}"
    if algo.startswith("sha256"):
        return "vLLM's fixed default"
    return "random, this process only (PYTHONHASHSEED unset)"


def consumer_fingerprint(layout: BlockLayout, naming_scheme: str, naming_seed: str, model: str) -> dict:
    """The hf decode side's fingerprint, in the producer's shape (fields it cannot know: None)."""
    return {
        "block_size": layout.block_size,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_size": layout.head_dim,
        "dtype": layout.dtype,
        "layout": f"omni-pd fused, translated from {VLLM_CPU_LAYOUT}",
        "prefix_caching_hash_algo": naming_scheme.removeprefix("vllm:"),
        "none_hash_seed": naming_seed,
        "model": model,
    }


def check_consumer(info: VllmProducerInfo, layout: BlockLayout, naming_scheme: str, naming_seed: str) -> None:
    """Raise KVIncompatibleError naming both values of every field where the producer and this
    decode engine differ: the KV geometry (check_geometry) and the block keys."""
    wrong: list[str] = []
    try:
        check_geometry(info.geometry, layout)
    except KVIncompatibleError as exc:
        wrong.append(str(exc))
    if naming_scheme != f"vllm:{info.hash_algo}":
        wrong.append(
            f"block keys: vLLM prefix_caching_hash_algo {info.hash_algo!r}, this engine names "
            f"blocks {naming_scheme!r}: set the hf decode stage's engine_args.prefix_caching_hash_algo "
            f"to {info.hash_algo!r}"
        )
    elif "random" in info.seed_rule or "random" in naming_seed or info.seed_rule != naming_seed:
        wrong.append(
            f"NONE_HASH seed: vLLM {info.seed_rule!r}, this engine {naming_seed!r}: give both "
            "engines the same PYTHONHASHSEED (or use sha256 / sha256_cbor unseeded)"
        )
    if wrong:
        raise KVIncompatibleError(
            "the vLLM prefill engine's KV cannot be taken by this decode engine: " + "; ".join(wrong)
        )
