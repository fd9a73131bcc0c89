"""omni-pd's hf prefill side as the producer of vLLM 0.32's MooncakeConnector protocol
(kv/vllm/serve.py, kv/vllm/bootstrap.py) and the reverse layout translation
(`vllm_layout.translate_blocks_to_vllm`).

The consumer here is omni-pd's own implementation of vLLM's consumer half (kv/vllm/pull.py,
which test_vllm_to_hf_kv.py runs against a real vLLM producer): it asks the bootstrap `/query`,
sends vLLM's msgpack `MooncakeXferMetadata` and waits for vLLM's response, so these tests check
the server's side of the exchange exactly and fast. e2e/test_hf_p_vllm_d.py runs a real,
unmodified vLLM decode engine against it. The checks:
- fused -> vLLM -> fused is exact both ways, the vLLM form is vLLM's `vec` packing (K dim-major,
  V token-major), and a wrong mapping is caught by the byte check (negative control);
- blocks offered by the server arrive in the consumer's memory byte for byte; a consumer that
  asks for fewer blocks gets the last ones (vLLM's partial prefix hit), exactly that many move;
- a consumer with another geometry is refused with both values named, a transfer nobody asks
  for expires after the lease, an unknown one is refused at once, nothing stays held.
"""

from __future__ import annotations

import pytest

from vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from omni_pd.kv.vllm import layout as vllm_layout  # noqa: E402
from omni_pd.kv.errors import KVIntegrityError, KVTransferError  # noqa: E402
from omni_pd.kv.layout import BlockLayout  # noqa: E402
from omni_pd.kv.transport import MooncakeTransport  # noqa: E402
from omni_pd.kv.vllm.layout import (  # noqa: E402
    geometry_of,
    layer_views,
    translate_blocks,
    translate_blocks_to_vllm,
)
from omni_pd.kv.vllm.pull import VllmKVPuller  # noqa: E402
from omni_pd.kv.vllm.serve import VllmKVServer  # noqa: E402

LAYOUT = BlockLayout(block_size=32, num_layers=3, num_kv_heads=2, head_dim=32, dtype="float32")
GEOMETRY = geometry_of(LAYOUT)
NUM_BLOCKS = 8


def _fused(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g)


def _views(blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    buffer = torch.zeros(blocks * GEOMETRY.block_bytes * GEOMETRY.num_layers, dtype=torch.uint8)
    return layer_views(buffer, GEOMETRY, blocks)


def test_fused_blocks_translate_into_vllms_vec_layout_and_back_exactly():
    fused, views = _fused(), _views()
    translate_blocks_to_vllm(fused, [1, 4, 6], views, [0, 2, 5])
    # vLLM's packing: per layer, block, head: K dim-major ([head_dim, block_size]), then V.
    bs, hd = LAYOUT.block_size, LAYOUT.head_dim
    for layer in range(LAYOUT.num_layers):
        block = views[layer][2]  # from fused block 4
        for head in range(LAYOUT.num_kv_heads):
            flat = block[head].reshape(-1)
            k = flat[: bs * hd].view(hd, bs)
            v = flat[bs * hd :].view(bs, hd)
            assert torch.equal(k.t(), fused[4, :, layer, 0, head])
            assert torch.equal(v, fused[4, :, layer, 1, head])
    back = torch.zeros_like(fused)
    translate_blocks(views, [0, 2, 5], back, [1, 4, 6])
    assert torch.equal(back[[1, 4, 6]].view(torch.uint8), fused[[1, 4, 6]].view(torch.uint8))
    # Negative control: a fused block differing in one value does not compare equal.
    other = back.clone()
    other[4, 3, 1, 0, 1, 7] += 1e-6
    assert not torch.equal(other[[1, 4, 6]], fused[[1, 4, 6]])


def test_a_wrong_mapping_is_caught_by_the_byte_check(monkeypatch):
    """Negative control for the check itself: a mapping that forgets to transpose K writes
    bytes that do not read back, refused before anything could be sent."""
    right = vllm_layout._vllm_of

    def k_not_transposed(block):
        out = right(block).clone()
        half = out.shape[2] // 2
        k = block.permute(1, 3, 2, 0, 4)[:, :, 0]  # [layers, heads, bs, hd], token-major
        out[:, :, :half] = k.reshape(out[:, :, :half].shape)
        return out

    monkeypatch.setattr(vllm_layout, "_vllm_of", k_not_transposed)
    with pytest.raises(KVIntegrityError, match="fused block 2 did not translate exactly into vLLM block 0"):
        translate_blocks_to_vllm(_fused(), [2], _views(), [0])


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def transports():
    return MooncakeTransport(), MooncakeTransport()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def server(transports, clock):
    s = VllmKVServer(transports[0], GEOMETRY, 16, "hf-prefill-test", lease_timeout_s=30.0, clock=clock)
    yield s
    s.close()


@pytest.fixture
def consumer(transports):
    p = VllmKVPuller(transports[1], GEOMETRY, staging_blocks=8)
    yield p
    p.close()


def _pull(server, consumer, transfer_id, blocks, wait_s=10.0):
    """Ask for `blocks` blocks of the transfer and wait for the server's answer (its error is
    raised by `consumer.poll`)."""
    worker = consumer.worker_address(server.bootstrap.address, server.engine_id, 5.0)
    assert worker == server.worker_addr
    pull = consumer.start(transfer_id, worker, blocks, wait_s)
    try:
        consumer.wait(pull, wait_s + 5)
    except KVTransferError:
        pass
    return pull


def _received(consumer, pull) -> torch.Tensor:
    out = torch.zeros((len(pull.staging), *_fused().shape[1:]))
    translate_blocks(consumer.layers, pull.staging, out, list(range(len(pull.staging))))
    return out


def test_offered_blocks_reach_the_consumer_byte_for_byte(server, consumer):
    fused = _fused(1)
    server.offer("t-whole", fused, [5, 2, 7, 0])
    assert server.debug_state_counts() == {"kv.vllm_offers": 1, "kv.vllm_offer_blocks_held": 4}
    pull = _pull(server, consumer, "t-whole", 4)
    assert consumer.poll(pull)
    got = _received(consumer, pull)
    assert torch.equal(got.view(torch.uint8), fused[[5, 2, 7, 0]].view(torch.uint8))
    assert not torch.equal(got, fused[[5, 2, 0, 7]])  # negative control: the order matters
    consumer.release(pull)
    assert (server.stats.sends, server.stats.blocks_sent) == (1, 4)
    assert server.debug_state_counts() == {"kv.vllm_offers": 0, "kv.vllm_offer_blocks_held": 0}
    assert consumer.debug_state_counts() == {"kv.vllm_pulls": 0, "kv.vllm_staging_blocks_held": 0}
    assert server.release("t-whole") is False  # already sent and freed


def test_a_consumer_holding_a_prefix_gets_only_the_last_blocks(server, consumer):
    """vLLM's partial prefix hit: a consumer with 2 of 4 blocks cached asks for 2 and gets the
    producer's last 2; exactly 2 blocks move."""
    fused = _fused(2)
    server.offer("t-delta", fused, [0, 1, 2, 3])
    before = server.stats.blocks_sent
    pull = _pull(server, consumer, "t-delta", 2)
    got = _received(consumer, pull)
    assert torch.equal(got, fused[[2, 3]])
    assert not torch.equal(got, fused[[0, 1]])
    consumer.release(pull)
    assert server.stats.blocks_sent - before == 2
    assert server.debug_state_counts()["kv.vllm_offers"] == 0


def test_a_consumer_asking_for_more_blocks_than_held_is_refused(server, consumer):
    server.offer("t-more", _fused(3), [0, 1])
    pull = _pull(server, consumer, "t-more", 3)
    with pytest.raises(KVTransferError, match="asks for 3 blocks, this producer holds 2"):
        consumer.poll(pull)
    consumer.release(pull)
    # Refused before taking the offer: held until released (or its lease expires).
    assert server.debug_state_counts() == {"kv.vllm_offers": 1, "kv.vllm_offer_blocks_held": 2}
    assert server.release("t-more") is True
    assert server.debug_state_counts() == {"kv.vllm_offers": 0, "kv.vllm_offer_blocks_held": 0}


def test_a_consumer_of_another_geometry_is_refused_naming_both_values(server, transports):
    other = VllmKVPuller(
        transports[1],
        vllm_layout.VllmKVGeometry(
            GEOMETRY.layer_names, GEOMETRY.layer_indices, 64, GEOMETRY.num_kv_heads, 32, "float32", "vec"
        ),
        staging_blocks=4,
    )
    try:
        server.offer("t-geo", _fused(4), [0, 1])
        pull = _pull(server, other, "t-geo", 2)
        with pytest.raises(KVTransferError) as err:
            other.poll(pull)
        message = str(err.value)
        assert f"vLLM decode [{2 * 2 * 64 * 32 * 4}], this producer {GEOMETRY.block_bytes}" in message
        assert "block size 32" in message
        other.release(pull)
    finally:
        other.close()
    # Refused before taking the offer: it is still held for a consumer that fits, until released.
    assert server.debug_state_counts()["kv.vllm_offers"] == 1
    assert server.release("t-geo") is True
    assert server.debug_state_counts() == {"kv.vllm_offers": 0, "kv.vllm_offer_blocks_held": 0}


def test_an_offer_nobody_asks_for_expires_after_the_lease(server, consumer, clock):
    server.offer("t-late", _fused(5), [0, 1, 2])
    clock.now += 29.0
    assert server.expire() == []
    clock.now += 2.0
    assert server.expire() == ["t-late"]
    assert server.debug_state_counts() == {"kv.vllm_offers": 0, "kv.vllm_offer_blocks_held": 0}
    pull = _pull(server, consumer, "t-late", 3)  # a consumer that comes after it: refused at once
    with pytest.raises(KVTransferError, match="t-late is not held by hf-prefill-test"):
        consumer.poll(pull)
    consumer.release(pull)
    assert consumer.debug_state_counts() == {"kv.vllm_pulls": 0, "kv.vllm_staging_blocks_held": 0}


def test_the_staging_bound_is_named_and_nothing_is_taken(server):
    with pytest.raises(Exception, match="17 vLLM staging blocks needed, 16 of 16 free"):
        server.offer("t-big", torch.zeros((17, *_fused().shape[1:])), list(range(17)))
    assert server.debug_state_counts() == {"kv.vllm_offers": 0, "kv.vllm_offer_blocks_held": 0}
