"""omni_pd.kv.vllm.block_hash against vLLM 0.32 itself, byte for byte.

The golden hashes come from a vLLM process started by this test (tests/vllm_block_hash_capture.py):
an in-process engine's own Request.block_hashes and block-pool keys (xxhash_cbor with a random
NONE_HASH seed, a cache salt, decode tokens filling a block), and vLLM Request objects hashed by the
block hasher its engine core builds, under every algorithm and PYTHONHASHSEED setting (multimodal
items, LoRA, cache salt, prompt embeddings, partial last blocks, decode-time blocks).
The tests without a vLLM process (encoding, errors, negative controls on the chain) run anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.sampling import SamplingParams
from omni_pd.kv.vllm.block_hash import (
    DEFAULT_NONE_HASH_SEED,
    SUPPORTED_ALGOS,
    MultimodalSpan,
    NoneHashSeedUnknown,
    UnknownHashAlgo,
    VllmBlockHasher,
    block_extra_keys,
    cbor_canonical,
)

from test_thinker_engine import _engine, _run_together, runner  # noqa: F401

HERE = Path(__file__).resolve().parent
BLOCK = 4  # the Request-level captures: small blocks, many of them
SEEDS = (None, "0", "1234")  # PYTHONHASHSEED unset, and set to two values
EMBEDS = (np.arange(9 * 8, dtype=np.float32).reshape(9, 8) / 7).round(3)

# Request name -> what vLLM's Request gets. Identifiers are distinct objects on both sides
# (JSON), as vLLM's multimodal hasher makes them.
REQUESTS = {
    "exact": {"prompt_token_ids": list(range(1, 13))},  # 3 full blocks
    "partial": {"prompt_token_ids": list(range(1, 15))},  # 3 full + 2 tokens: no 4th hash
    "changed": {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12, 13, 14]},  # block 1
    "short": {"prompt_token_ids": [7, 8, 9]},  # no full block
    "decode": {"prompt_token_ids": [11, 12, 13, 14, 15, 16], "output_token_ids": [5, 6, 7, 8, 9, 10, 11]},
    "wide_ids": {
        "prompt_token_ids": [0, 23, 24, 255, 256, 65535, 65536, 151643, 2**32 - 1, 2**32, 2**40, 7]
    },  # every CBOR integer width
    "mm": {
        "prompt_token_ids": [1, 2] + [9] * 7 + [9] * 2 + [3] + [8] * 5 + [4, 5, 6],
        # img-a spans blocks 0-2 (offsets 2, -2, -6); img-b ends in block 2 beside it;
        # img-a again (equal identifier, another item) in blocks 3-4
        "mm": [["img-a", 2, 7], ["img-b", 9, 2], ["img-a", 12, 5]],
    },
    "mm_other_id": {
        "prompt_token_ids": [1, 2] + [9] * 7 + [9] * 2 + [3] + [8] * 5 + [4, 5, 6],
        "mm": [["img-a", 2, 7], ["img-X", 9, 2], ["img-a", 12, 5]],
    },
    "mm_twice": {"prompt_token_ids": [1, 9, 9, 2, 3, 4], "mm": [["img-a", 1, 1], ["img-a", 2, 1]]},
    "lora": {
        "prompt_token_ids": list(range(1, 10)),
        "lora": ["adapter", "/loras/adapter-v1"],
        "output_token_ids": [40, 41, 42],
    },
    "salt": {"prompt_token_ids": list(range(1, 10)), "cache_salt": "tenant-7"},
    "everything": {
        "prompt_token_ids": [1, 2, 9, 9, 9, 9, 9, 3, 4, 5, 6],
        "mm": [["aud-1", 2, 5]],
        "lora": ["ad", "/p"],
        "cache_salt": "s",
    },
    "embeds": {"prompt_embeds": EMBEDS.tolist()},  # vLLM's token ids: zeros
}
ENGINE = {
    "algo": "xxhash_cbor",
    "pythonhashseed": None,
    "block_size": 32,
    "prompt_token_ids": [(5 * i + 3) % 250 + 1 for i in range(70)],
    "cache_salt": "salt-1",
    "max_tokens": 30,
}  # 70 + 30 tokens: blocks 0-1 from the prompt, block 2 from decoding
# vLLM engines whose prompt blocks the hf engine must name the same (its prefix_caching_hash_algo):
# vLLM's default-seeded sha256_cbor, and pickle + xxh3 under a set PYTHONHASHSEED.
HF_BLOCK = 32  # vLLM CPU attention: a multiple of 32
HF_PROMPT = [(7 * i + 5) % 240 + 3 for i in range(140)]  # 4 full blocks of 32 and 12 tokens
HF_ENGINES = [
    {
        "algo": algo,
        "pythonhashseed": seed,
        "block_size": HF_BLOCK,
        "prompt_token_ids": HF_PROMPT,
        "cache_salt": None,
        "max_tokens": 2,  # 142 tokens: vLLM caches the 4 prompt blocks only
    }
    for algo, seed in (("sha256_cbor", None), ("xxhash", "7"))
]


def omni_pd_hashes(hasher: VllmBlockHasher, spec: dict, block_size: int = BLOCK) -> list[bytes]:
    tokens = spec.get("prompt_token_ids") or [0] * len(spec["prompt_embeds"])
    tokens = tokens + spec.get("output_token_ids", [])
    lora = spec.get("lora")
    keys = block_extra_keys(
        len(tokens),
        block_size,
        mm_spans=[MultimodalSpan(*item) for item in spec.get("mm", [])],
        lora=None if lora is None else (lora[0], lora[1]),
        cache_salt=spec.get("cache_salt"),
        prompt_embeds=None
        if "prompt_embeds" not in spec
        else np.asarray(spec["prompt_embeds"], dtype=np.float32),
    )
    return hasher.block_hashes(tokens, block_size, keys)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:  # not `import vllm`: 15 s here
        from omni_pd.engines.vllm import INSTALL_HINT

        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI=true but {INSTALL_HINT}", pytrace=False)
        pytest.skip(INSTALL_HINT)
    from omni_pd.models.qwen3_text.tiny_config import ensure_tiny_text_model

    tmp = tmp_path_factory.mktemp("vllm_block_hash")
    spec = {
        "model_dir": str(ensure_tiny_text_model()),
        "block_size": BLOCK,
        "engines": [ENGINE, *HF_ENGINES],
        "configs": [{"algo": a, "pythonhashseed": s} for a in SUPPORTED_ALGOS for s in SEEDS],
        "requests": REQUESTS,
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run(
        [
            sys.executable,
            str(HERE / "vllm_block_hash_capture.py"),
            str(tmp / "spec.json"),
            str(tmp / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads((tmp / "out.json").read_text())
    configs = {
        (c["algo"], c["pythonhashseed"]): captured for c, captured in zip(spec["configs"], out["configs"])
    }
    return {"engine": out["engines"][0], "hf_engines": out["engines"][1:], "configs": configs}


def to_bytes(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


# ---- against a vLLM engine -------------------------------------------------------------------


@pytest.mark.slow
def test_engine_request_block_hashes_equal_omni_pd(golden):
    engine = golden["engine"]
    assert engine["algo"] == "xxhash_cbor" and engine["block_size"] == 32
    tokens = engine["all_token_ids"]
    assert tokens[:70] == ENGINE["prompt_token_ids"] and len(tokens) == 100
    # PYTHONHASHSEED unset + xxhash: vLLM drew a random seed, which only it could tell us
    assert engine["seed"] != DEFAULT_NONE_HASH_SEED and len(engine["seed"]) == 64
    with pytest.raises(NoneHashSeedUnknown):
        VllmBlockHasher("xxhash_cbor")
    hasher = VllmBlockHasher("xxhash_cbor", engine["seed"])
    assert hasher.none_hash.hex() == engine["none_hash"]

    keys = block_extra_keys(len(tokens), 32, cache_salt=ENGINE["cache_salt"])
    ours = hasher.block_hashes(tokens, 32, keys)
    assert len(ours) == 3  # the third block holds decode tokens 70..95; 96..99 are partial
    assert ours == to_bytes(engine["block_hashes"])
    # the KV cache manager cached the computed blocks under exactly these hashes
    assert set(ours) <= set(to_bytes(engine["cached_block_hashes"]))

    # negative controls: without the salt, or one decode token changed, the hashes are not vLLM's
    unsalted = hasher.block_hashes(tokens, 32)
    assert not set(unsalted) & set(to_bytes(engine["cached_block_hashes"]))
    changed = tokens[:80] + [tokens[80] + 1] + tokens[81:]
    assert hasher.block_hashes(changed, 32, keys)[:2] == ours[:2]
    assert hasher.block_hashes(changed, 32, keys)[2] != ours[2]


@pytest.mark.slow
@pytest.mark.parametrize("which", range(len(HF_ENGINES)))
def test_hf_engine_names_its_cached_blocks_with_vllm_engine_keys(golden, runner, which, monkeypatch):
    """An hf thinker stage with `prefix_caching_hash_algo` caches a prompt's blocks under exactly
    the keys a vLLM engine (same algorithm, same PYTHONHASHSEED) caches them under."""
    entry, theirs = HF_ENGINES[which], golden["hf_engines"][which]
    assert (theirs["algo"], theirs["block_size"]) == (entry["algo"], HF_BLOCK)
    vllm_keys = to_bytes(theirs["block_hashes"])
    assert len(vllm_keys) == 4 and set(vllm_keys) <= set(to_bytes(theirs["cached_block_hashes"]))
    if entry["pythonhashseed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", entry["pythonhashseed"])

    def cached_keys(**engine_args) -> list[bytes]:
        engine = _engine(runner, kv_block_size=HF_BLOCK, **engine_args)
        _run_together(engine, [ThinkerPrompt(list(HF_PROMPT))], [SamplingParams(temperature=0, max_tokens=2)])
        prefix = engine.kv.prefix
        assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
        named = {entry.hash: block for block, entry in prefix._entries.items()}
        keys = prefix.block_hashes(HF_PROMPT)
        assert len(keys) == 4 and set(keys) == set(named)  # what it cached is what it names
        return keys

    assert cached_keys(prefix_caching_hash_algo=entry["algo"]) == vllm_keys
    # negative controls: omni-pd's own naming, and another seed, give none of vLLM's keys
    assert not set(cached_keys()) & set(vllm_keys)
    monkeypatch.setenv("PYTHONHASHSEED", "other")
    assert not set(cached_keys(prefix_caching_hash_algo=entry["algo"])) & set(vllm_keys)


# ---- against vLLM's Request + block hasher, every algorithm and seed --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("algo", SUPPORTED_ALGOS)
@pytest.mark.parametrize("seed", SEEDS)
def test_request_block_hashes_equal_omni_pd(golden, algo, seed):
    captured = golden["configs"][(algo, seed)]
    # vLLM's rule: PYTHONHASHSEED wins; unset, sha256* use the fixed seed, xxhash* a random one
    if seed is not None:
        assert captured["seed"] == seed
    elif algo.startswith("sha256"):
        assert captured["seed"] == DEFAULT_NONE_HASH_SEED
    else:
        assert captured["seed"] != DEFAULT_NONE_HASH_SEED and len(captured["seed"]) == 64
        with pytest.raises(NoneHashSeedUnknown, match=algo):
            VllmBlockHasher(algo, seed)
    hasher = VllmBlockHasher(
        algo, seed if seed is not None or algo.startswith("sha256") else captured["seed"]
    )
    assert hasher.none_hash.hex() == captured["none_hash"]
    assert len(hasher.none_hash) == (32 if algo.startswith("sha256") else 16)

    for name, spec in REQUESTS.items():
        theirs = to_bytes(captured["requests"][name]["block_hashes"])
        ours = omni_pd_hashes(hasher, spec)
        n_tokens = len(captured["requests"][name]["all_token_ids"])
        assert len(theirs) == n_tokens // BLOCK, name  # full blocks only, in vLLM too
        assert ours == theirs, f"{algo} PYTHONHASHSEED={seed} request {name}"

    got = {name: to_bytes(r["block_hashes"]) for name, r in captured["requests"].items()}
    # negative control, in vLLM's own numbers: one token changed in block 1 -> block 0 the same,
    # blocks 1 and 2 different
    assert got["changed"][0] == got["partial"][0]
    assert all(a != b for a, b in zip(got["changed"][1:], got["partial"][1:]))
    assert got["partial"] == got["exact"]  # the partial block changed nothing
    # another identifier for img-b: block 2 (where it sits) and on differ, blocks 0-1 do not
    assert got["mm_other_id"][:2] == got["mm"][:2] and got["mm_other_id"][2] != got["mm"][2]
    # the salt and the LoRA change the hashes of the same tokens from block 0 on
    assert got["salt"][0] != got["lora"][0] and got["salt"][0] != got["exact"][0]


@pytest.mark.slow
def test_algorithms_and_seeds_are_told_apart(golden):
    """The comparison above can fail: another algorithm or seed gives other hashes."""
    spec = REQUESTS["exact"]
    for algo in SUPPORTED_ALGOS:
        theirs = to_bytes(golden["configs"][(algo, "0")]["requests"]["exact"]["block_hashes"])
        assert omni_pd_hashes(VllmBlockHasher(algo, "0"), spec) == theirs
        assert omni_pd_hashes(VllmBlockHasher(algo, "1"), spec)[0] != theirs[0]
        for other in SUPPORTED_ALGOS:
            if other != algo:
                assert omni_pd_hashes(VllmBlockHasher(other, "0"), spec)[0] != theirs[0]
    # the random xxhash seeds are fresh per initialization (engine, and each capture)
    randoms = {
        golden["engine"]["seed"],
        golden["configs"][("xxhash", None)]["seed"],
        golden["configs"][("xxhash_cbor", None)]["seed"],
    }
    assert len(randoms) == 3


# ---- without vLLM ----------------------------------------------------------------------------


def test_cbor_encoding_is_cbor2_canonical():
    cbor2 = pytest.importorskip("cbor2")  # vLLM's own serializer, where vLLM is installed
    values = [
        None,
        True,
        False,
        0,
        1,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        2**64 - 1,
        2**64,
        2**100,
        -1,
        -24,
        -25,
        -256,
        -257,
        -(2**64),
        -(2**64) - 1,
        -(2**90),
        "",
        "a",
        "é漢",
        "x" * 23,
        "x" * 24,
        "x" * 255,
        "x" * 256,
        "y" * 70000,
        b"",
        b"\x00",
        b"b" * 24,
        b"b" * 65536,
        (),
        (1, (2, (3,)), "s", b"t", None),
        tuple(range(30)),
        [1, 2],
        ("mm", "img", -6),
    ]
    for value in values:
        assert cbor_canonical(value) == cbor2.dumps(value, canonical=True), repr(value)[:60]
    assert cbor_canonical(1) != cbor_canonical(-1) != cbor_canonical(True)
    with pytest.raises(TypeError, match="float"):
        cbor_canonical((1.5,))


def test_unknown_algorithm_is_refused_by_name():
    with pytest.raises(UnknownHashAlgo) as err:
        VllmBlockHasher("md5")
    assert "'md5'" in str(err.value)
    assert all(algo in str(err.value) for algo in SUPPORTED_ALGOS)


def test_chain_and_inputs():
    hasher = VllmBlockHasher("sha256_cbor")  # unseeded sha256: the fixed seed
    assert hasher.seed == DEFAULT_NONE_HASH_SEED
    tokens = list(range(10))
    hashes = hasher.block_hashes(tokens, 4)
    assert len(hashes) == 2 and hashes == hasher.block_hashes(tokens[:8], 4)  # partial: no hash
    assert hashes == hasher.block_hashes(np.array(tokens, dtype=np.int64), 4)  # numpy ids
    assert hasher.block_hashes(tokens, 4, [(), None]) == hashes  # no keys = None, as in vLLM
    changed = tokens[:5] + [55] + tokens[6:]
    assert hasher.block_hashes(changed, 4)[0] == hashes[0]
    assert hasher.block_hashes(changed, 4)[1] != hashes[1]
    keyed = hasher.block_hashes(tokens, 4, [None, (("mm", "i", -2),)])
    assert keyed[0] == hashes[0] and keyed[1] != hashes[1]
    with pytest.raises(ValueError, match="2 full blocks"):
        hasher.block_hashes(tokens, 4, [None])
    with pytest.raises(ValueError, match="tag"):
        hasher.block_hashes(tokens, 4, [None, ("mm",)])  # a key, not a tuple of keys
    with pytest.raises(ValueError, match="sorted and disjoint"):
        block_extra_keys(8, 4, mm_spans=[MultimodalSpan("a", 2, 3), MultimodalSpan("b", 4, 1)])


def test_pickle_keys_do_not_depend_on_the_callers_objects():
    """Pickle writes a repeated object as a back-reference: one identifier object used twice
    must hash as two equal objects do (how vLLM's keys are built)."""
    hasher = VllmBlockHasher("sha256", "0")
    shared = "img-shared"
    one_object = (("mm", shared, 0), ("mm", shared, 2))
    two_objects = (("mm", "".join(["img-", "shared"]), 0), ("mm", "".join(["img-", "shared"]), 2))
    assert one_object[0][1] is one_object[1][1] and two_objects[0][1] is not two_objects[1][1]
    assert hasher.hash_block(None, [1, 2], one_object) == hasher.hash_block(None, [1, 2], two_objects)
    assert hasher.hash_block(None, [1, 2], one_object) != hasher.hash_block(None, [1, 2], None)
