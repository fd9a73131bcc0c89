"""KV fingerprints: the first handoff between two engines refuses an incompatible pair, naming
every differing field with both values; compatible peers are remembered."""

import pytest
import torch

from omni_pd.kv import BlockLayout, KVIncompatibleError
from omni_pd.kv.fingerprint import (
    FULL_HASH_LIMIT_BYTES,
    PeerFingerprints,
    incompatible_fields,
    kv_fingerprint,
    weights_digest,
)

LAYOUT = BlockLayout.default_for(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16)


def _weights(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(8, 4, generator=g).to(dtype)),
        ("b.bias", torch.randn(3, generator=g).to(dtype)),
    ]


def _fp(engine_id="decode-0", **changes):
    return {**kv_fingerprint("tiny (Thinker)", weights_digest(_weights()), LAYOUT, engine_id), **changes}


def test_weights_digest_tells_weights_apart():
    assert weights_digest(_weights()) == weights_digest(_weights())
    assert weights_digest(_weights()).startswith("full:")
    assert weights_digest(_weights(seed=1)) != weights_digest(_weights())
    assert weights_digest(_weights(dtype=torch.bfloat16)) != weights_digest(_weights())  # bf16 hashes too
    renamed = [("c.weight", t) for _, t in _weights()[:1]] + _weights()[1:]
    assert weights_digest(renamed) != weights_digest(_weights())


def test_large_models_are_sampled_not_read_whole():
    big = torch.zeros(FULL_HASH_LIMIT_BYTES // 4 + 1)
    other = big.clone()
    other[-1] = 1.0  # past the first 64 KiB: sampling does not see it (said in the docstring)
    assert weights_digest([("w", big)]).startswith("sampled:")
    assert weights_digest([("w", big)]) == weights_digest([("w", other)])
    early = big.clone()
    early[0] = 1.0
    assert weights_digest([("w", big)]) != weights_digest([("w", early)])


def test_identical_fingerprints_pass_and_are_cached():
    peers = PeerFingerprints(_fp())
    remote = _fp(engine_id="prefill-0")
    peers.check("prefill-0", remote)
    assert peers.is_verified("prefill-0")
    peers.check("prefill-0", remote)  # served from the cache


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "other-model"),
        ("weights", "full:deadbeef"),
        ("dtype", "bfloat16"),
        ("num_layers", 5),
        ("num_kv_heads", 4),
        ("head_dim", 32),
    ],
)
def test_a_differing_field_is_refused_and_named(field, value):
    peers = PeerFingerprints(_fp())
    with pytest.raises(KVIncompatibleError) as info:
        peers.check("prefill-0", _fp(engine_id="prefill-0", **{field: value}))
    message = str(info.value)
    assert f"{field}: prefill {value!r}, decode {_fp()[field]!r}" in message
    assert "prefill-0" in message and "decode-0" in message
    assert not peers.is_verified("prefill-0")


def test_every_differing_field_is_named_and_missing_ones_too():
    remote = _fp(engine_id="p", model="m2", head_dim=8)
    del remote["weights"]
    assert incompatible_fields(_fp(), remote) == ["head_dim", "model", "weights"]
    with pytest.raises(KVIncompatibleError, match=r"weights: prefill <missing>"):
        PeerFingerprints(_fp()).check("p", remote)


def test_block_size_and_layout_may_differ_the_handoff_converts_them():
    other = BlockLayout(
        block_size=8,
        num_layers=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        kv_split="split",
        order="head_major",
    )
    remote = kv_fingerprint("tiny (Thinker)", weights_digest(_weights()), other, "prefill-0")
    PeerFingerprints(_fp()).check("prefill-0", remote)


def test_a_peer_back_under_the_same_id_with_other_weights_is_checked_again():
    peers = PeerFingerprints(_fp())
    peers.check("prefill-0", _fp(engine_id="prefill-0"))
    with pytest.raises(KVIncompatibleError, match="weights"):
        peers.check("prefill-0", _fp(engine_id="prefill-0", weights="full:0"))


def test_no_fingerprint_is_refused():
    with pytest.raises(KVIncompatibleError, match="sent no kv_fingerprint"):
        PeerFingerprints(_fp()).check("vllm-prefill", None)


def test_the_cache_is_bounded():
    peers = PeerFingerprints(_fp(), capacity=2)
    for name in ("p1", "p2", "p3"):
        peers.check(name, _fp(engine_id=name))
    assert [peers.is_verified(n) for n in ("p1", "p2", "p3")] == [False, True, True]


COMPUTE = {
    "device": "cpu",
    "torch": "2.13.0+cpu",
    "cpu_capability": "avx512",
    "native": {"attention": "avx512-0123456789abcdef"},
}


def _with_compute(engine_id, **changes):
    return kv_fingerprint(
        "tiny (Thinker)", weights_digest(_weights()), LAYOUT, engine_id, {**COMPUTE, **changes}
    )


def test_other_kernels_warn_once_naming_both_sides(caplog):
    """A prefill that computes with other kernels (another CPU level, another native build)
    is accepted, with one WARNING at its first handoff naming what differs on each side."""
    peers = PeerFingerprints(_with_compute("decode-0"))
    remote = _with_compute("prefill-0", cpu_capability="avx2", native={"attention": "avx2-fedcba9876543210"})
    with caplog.at_level("WARNING", logger="omni_pd.kv.fingerprint"):
        peers.check("prefill-0", remote)
        peers.check("prefill-0", remote)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "cpu_capability: prefill 'avx2', decode 'avx512'" in warnings[0]
    assert "avx2-fedcba9876543210" in warnings[0] and "prefill-0" in warnings[0]
    assert "require_identical_kernels" in warnings[0]
    # Negative control: the same kernels warn nothing.
    caplog.clear()
    with caplog.at_level("WARNING", logger="omni_pd.kv.fingerprint"):
        PeerFingerprints(_with_compute("decode-0")).check("prefill-1", _with_compute("prefill-1"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_require_identical_kernels_refuses_other_kernels():
    peers = PeerFingerprints(_with_compute("decode-0"), require_identical_kernels=True)
    peers.check("prefill-1", _with_compute("prefill-1"))  # the same kernels pass
    with pytest.raises(
        KVIncompatibleError,
        match=r"device: prefill 'cuda H100 sm_90', decode 'cpu'.*"
        r"require_identical_kernels is true",
    ):
        peers.check("prefill-0", _with_compute("prefill-0", device="cuda H100 sm_90"))
    assert not peers.is_verified("prefill-0")
    # A peer that sends no compute identity (an older omni-pd) differs in every key.
    with pytest.raises(KVIncompatibleError, match="cpu_capability: prefill <missing>"):
        peers.check("prefill-2", _fp(engine_id="prefill-2"))
