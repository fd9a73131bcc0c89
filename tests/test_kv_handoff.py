"""The KV handoff over real Mooncake (loopback TCP): two TransferEngines in this process, plus one
sender in a spawned child process."""

import dataclasses
import logging
import multiprocessing
import os
import socket
import time

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from omni_pd.kv import (
    BlockLayout,
    IllegalTransition,
    KVDescriptor,
    KVIntegrityError,
    KVReceiver,  # noqa: E402
    KVSender,
    KVTransferError,
    MooncakeTransport,
    PoolExhausted,
    TransferState,
)
from omni_pd import faults  # noqa: E402
from omni_pd.kv.handoff import Lease, Transfer  # noqa: E402
from omni_pd.kv.layout import unpack_blocks  # noqa: E402
from omni_pd.kv.pool import BlockPool  # noqa: E402

LAYOUT = BlockLayout.default_for(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16)


def make_kv(num_tokens: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, 2, num_tokens, 16, generator=g).to(dtype)


@pytest.fixture(scope="module")
def transports():
    # Mooncake has no shutdown: engines live until the process exits, so build two per module.
    return MooncakeTransport(), MooncakeTransport()


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def sender(transports, clock):
    s = KVSender("prefill-test", LAYOUT, 32, transports[0], lease_timeout_s=30.0, clock=clock)
    yield s
    # Invariant 2: nothing outlives its request. Tests release what they publish.
    assert s.debug_state_counts() == {"leases": 0, "used_blocks": 0}
    s.close()
    assert transports[0].registered_bytes == 0


@pytest.fixture
def receiver(transports):
    r = KVReceiver(LAYOUT, 32, transports[1])
    yield r
    assert r.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    r.close()
    assert transports[1].registered_bytes == 0


def test_fetch_is_bit_exact_and_moves_only_prompt_bytes(sender, receiver):
    kv = make_kv(37)
    desc = sender.publish("t-exact", kv)
    assert sender.debug_state_counts() == {"leases": 1, "used_blocks": 3}
    result = receiver.fetch(KVDescriptor.from_params(desc.to_params()))
    assert torch.equal(result.kv_canonical, kv)
    assert result.bytes_transferred == 37 * LAYOUT.bytes_per_token
    assert result.num_segments == 1  # contiguous blocks on both sides coalesce
    assert result.transfer_ms > 0 and not result.converted  # read in place: no staging, no unpack
    assert sender.release("t-exact") is True
    assert sender.release("t-exact") is False


def test_heterogeneous_layouts_are_converted(sender, transports):
    decode_layout = BlockLayout(
        block_size=8,
        num_layers=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="bfloat16",
        kv_split="split",
        order="head_major",
    )
    receiver = KVReceiver(decode_layout, 32, transports[1])
    try:
        kv = make_kv(21, seed=1)
        sender.publish("t-hetero", kv)  # so the fetched remote blocks do not start at id 0
        desc = KVDescriptor.from_params(sender.publish("t-hetero-2", kv).to_params())
        result = receiver.fetch(desc)
        assert result.kv_canonical.dtype == torch.bfloat16
        assert torch.equal(result.kv_canonical, kv.to(torch.bfloat16)) and result.converted
        assert result.bytes_transferred == 21 * LAYOUT.bytes_per_token
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    finally:
        for tid in ("t-hetero", "t-hetero-2"):
            sender.release(tid)
        receiver.close()


def test_scattered_remote_blocks(sender, receiver, transports):
    fillers = [f"t-fill-{i}" for i in range(32)]
    for tid in fillers:
        sender.publish(tid, make_kv(1))
    for i in (5, 9, 20):  # leave three separated holes
        sender.release(fillers[i])
    kv = make_kv(40, seed=4)
    desc = sender.publish("t-scatter", kv)
    assert desc.remote_block_ids == (5, 9, 20)
    result = receiver.fetch(desc)
    assert torch.equal(result.kv_canonical, kv) and result.num_segments == 3
    other = BlockLayout(
        block_size=5,
        num_layers=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        kv_split="fused",
        order="head_major",
    )
    hetero = KVReceiver(other, 64, transports[1])
    try:
        # Remote blocks straddle local block boundaries (16 KiB staged over 2.5 KiB blocks).
        result = hetero.fetch(desc)
        assert torch.equal(result.kv_canonical, kv.to(torch.float16)) and result.num_segments == 3
    finally:
        hetero.close()
    for tid in ["t-scatter"] + [t for i, t in enumerate(fillers) if i not in (5, 9, 20)]:
        assert sender.release(tid)


def test_incompatible_geometry_fails_before_transfer(sender, transports):
    other = BlockLayout.default_for(num_layers=4, num_kv_heads=4, head_dim=16, dtype="float32")
    receiver = KVReceiver(other, 8, transports[1])
    try:
        desc = sender.publish("t-geom", make_kv(5))
        with pytest.raises(ValueError, match="kv heads"):
            receiver.fetch(desc)
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    finally:
        sender.release("t-geom")
        receiver.close()


def test_injected_fault_travels_undetected(sender, receiver):
    kv = make_kv(20, seed=2)
    faults.arm("kv.publish.flip", block_index=1, byte_offset=5)
    desc = sender.publish("t-fault", kv)
    result = receiver.fetch(desc)  # checksums were computed after the flip, so they pass
    diff = result.kv_canonical != kv
    assert diff.sum().item() == 1  # exactly one float changed: the output comparison must notice
    sender.release("t-fault")
    # The hook fires once: the next publish is clean.
    desc = sender.publish("t-clean", kv)
    assert torch.equal(receiver.fetch(desc).kv_canonical, kv)
    sender.release("t-clean")


def test_injected_fault_after_checksumming_is_caught(sender, receiver):
    faults.arm("kv.publish.flip", block_index=1, byte_offset=5, after_checksum=True)
    desc = sender.publish("t-late-fault", make_kv(20, seed=2))
    with pytest.raises(KVIntegrityError, match=r"t-late-fault: block 1 "):
        receiver.fetch(desc)
    sender.release("t-late-fault")


def test_fault_outside_the_transferred_bytes_is_rejected(sender):
    faults.arm("kv.publish.flip", block_index=0, byte_offset=3 * LAYOUT.bytes_per_token)
    with pytest.raises(ValueError, match="outside"):
        sender.publish("t-badfault", make_kv(2))
    assert sender.debug_state_counts() == {"leases": 0, "used_blocks": 0}


def test_converted_fetch_into_scattered_staging_blocks_checks_every_block(sender, transports):
    """Layouts differ and the receiver's free blocks are scattered: each remote block lands in
    pieces across non-adjacent staging blocks and is checked there, piece by piece (no gather
    of the whole staging area); a corrupted remote block is still caught on that path."""
    other = BlockLayout(
        block_size=5,
        num_layers=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        kv_split="fused",
        order="head_major",
    )
    hetero = KVReceiver(other, 64, transports[1])
    held = hetero.pool.allocate(64)
    hetero.pool.free(held[::2])  # only every other block is free: no two free blocks adjoin
    try:
        kv = make_kv(40, seed=5)
        desc = KVDescriptor.from_params(sender.publish("t-scattered-staging", kv).to_params())
        result = hetero.fetch(desc)
        assert torch.equal(result.kv_canonical, kv.to(torch.float16)) and result.converted
        assert result.blocks == sorted(result.blocks) and all(b % 2 == 0 for b in result.blocks)
        sender.pool.block_view(desc.remote_block_ids[2])[5000] ^= 0xFF
        with pytest.raises(KVIntegrityError, match=r"t-scattered-staging: block 2 "):
            hetero.fetch(desc)
        assert hetero.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    finally:
        sender.release("t-scattered-staging")
        hetero.pool.free(held[1::2])
        hetero.close()


def test_memory_changed_after_publish_raises_integrity_error(sender, receiver):
    desc = sender.publish("t-corrupt", make_kv(40, seed=3))
    sender.pool.block_view(desc.remote_block_ids[1])[100] ^= 0xFF
    with pytest.raises(KVIntegrityError, match=r"t-corrupt: block 1 "):
        receiver.fetch(desc)
    # Without verification the corrupted bytes arrive: the checksum is what caught it.
    assert not torch.equal(receiver.fetch(desc, verify_checksums=False).kv_canonical, make_kv(40, seed=3))
    sender.release("t-corrupt")


def test_expire_leases_with_fake_clock(sender, clock, caplog):
    sender.publish("t-old", make_kv(17))
    clock.now += 20
    sender.publish("t-new", make_kv(3))
    assert sender.expire_leases() == []
    clock.now += 15  # t-old is 35 s old (timeout 30), t-new 15 s
    with caplog.at_level(logging.WARNING, logger="omni_pd.kv.handoff"):
        assert sender.expire_leases() == ["t-old"]
        assert sender.expire_leases() == []
    expiries = [r for r in caplog.records if "t-old" in r.getMessage()]
    assert len(expiries) == 1 and "2 KV blocks" in expiries[0].getMessage()
    assert sender.debug_state_counts() == {"leases": 1, "used_blocks": 1}
    assert sender.release("t-old") is False  # a late acknowledgement finds nothing
    assert sender.release("t-new") is True


def test_sender_pool_exhaustion_leaves_no_lease(sender):
    sender.publish("t-big", make_kv(16 * 30))
    with pytest.raises(PoolExhausted, match="kv_pool_blocks"):
        sender.publish("t-toomuch", make_kv(16 * 3))
    assert sender.debug_state_counts() == {"leases": 1, "used_blocks": 30}
    with pytest.raises(ValueError, match="already published"):
        sender.publish("t-big", make_kv(1))
    sender.release("t-big")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_peer_fails_fast_and_leaves_no_state(sender, receiver, transports):
    desc = sender.publish("t-dead", make_kv(30))
    dead = f"127.0.0.1:{_free_port()}"
    params = {**desc.to_params(), "remote_session": dead}
    began = time.monotonic()
    with pytest.raises(KVTransferError, match=rf"peer {dead} failed.*1 segments, 30720 bytes"):
        receiver.fetch(KVDescriptor.from_params(params))
    assert time.monotonic() - began < 3.0
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    assert transports[1].probe(transports[0].session_id) is True
    sender.release("t-dead")


def test_descriptor_params_sit_beside_vllm_keys_and_validate():
    desc = KVDescriptor(
        transfer_id="x1",
        remote_engine_id="p0",
        remote_session="127.0.0.1:1",
        remote_block_ids=(4, 5),
        remote_base_address=4096,
        block_bytes=LAYOUT.block_bytes,
        num_tokens=20,
        kv_layout=LAYOUT,
        block_checksums=("00" * 8, "11" * 8),
    )
    params = {"do_remote_prefill": True, "do_remote_decode": False, **desc.to_params()}
    assert KVDescriptor.from_params(params) == desc
    assert params["do_remote_prefill"] is True  # vLLM's keys are untouched
    for key in KVDescriptor.KEYS[1:]:
        with pytest.raises(ValueError, match=rf"transfer x1.*{key}|{key}.*transfer x1"):
            KVDescriptor.from_params({k: v for k, v in params.items() if k != key})
    with pytest.raises(ValueError, match=r"'num_tokens'.*x1.*expected int"):
        KVDescriptor.from_params({**params, "num_tokens": "20"})
    with pytest.raises(ValueError, match=r"x1: 40 tokens need 3 blocks"):
        KVDescriptor.from_params({**params, "num_tokens": 40})
    with pytest.raises(ValueError, match=r"kv_layout.*x1.*kv_layout\.dtype"):
        KVDescriptor.from_params({**params, "kv_layout": {**LAYOUT.to_dict(), "dtype": "int4"}})
    with pytest.raises(ValueError, match="missing 'transfer_id'"):
        KVDescriptor.from_params({k: v for k, v in params.items() if k != "transfer_id"})


def test_state_machine_rejects_illegal_transitions():
    lease = Lease("a", [0], TransferState.PUBLISHED, deadline=1.0)
    lease.move(TransferState.DONE)
    with pytest.raises(IllegalTransition, match="a: illegal transition DONE -> EXPIRED"):
        lease.move(TransferState.EXPIRED)
    transfer = Transfer("b", [0], TransferState.TRANSFERRING)
    with pytest.raises(IllegalTransition):
        transfer.move(TransferState.EXPIRED)
    transfer.move(TransferState.FAILED, "boom")
    with pytest.raises(IllegalTransition):
        transfer.move(TransferState.DONE)


# -- sender in another process -----------------------------------------------------------------


def _sender_process(conn, num_tokens: int, seed: int) -> None:
    sender = KVSender("prefill-child", LAYOUT, 16, MooncakeTransport(), lease_timeout_s=60.0)
    kv = make_kv(num_tokens, seed)
    conn.send(sender.publish("t-child", kv).to_params())
    transfer_id = conn.recv()  # the decode side's acknowledgement
    conn.send((sender.release(transfer_id), sender.debug_state_counts()))
    sender.close()


def test_sender_in_spawned_process(receiver):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_process, args=(child, 50, 7), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "sender child did not publish"
        desc = KVDescriptor.from_params(parent.recv())
        assert desc.remote_engine_id == "prefill-child"
        result = receiver.fetch(desc)
        assert torch.equal(result.kv_canonical, make_kv(50, 7))
        assert result.bytes_transferred == 50 * LAYOUT.bytes_per_token
        parent.send("t-child")
        assert parent.poll(30), "sender child did not acknowledge the release"
        assert parent.recv() == (True, {"leases": 0, "used_blocks": 0})
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_a_read_lands_in_the_blocks_handed_over_and_they_come_back(sender, receiver):
    """The decode engine's path: its own (scattered) cache blocks receive the KV in place and
    come back with the result; a bad hand-over is refused before the receiver takes the blocks."""
    kv = make_kv(40, seed=5)
    desc = sender.publish("t-into", kv)
    spare = receiver.pool.allocate(6)
    into = [spare[4], spare[1], spare[2]]  # not one run: three entries
    with pytest.raises(ValueError, match="need 3 destination blocks, got 2"):
        receiver.start(desc, into=into[:2])
    receiver.start(desc, into=into)
    assert receiver.debug_state_counts()["used_blocks"] == 3 and receiver.blocks_held == 3
    while (result := receiver.poll("t-into")) is None:
        time.sleep(0.001)
    assert result.blocks == into and not result.converted and result.num_segments >= 2
    assert torch.equal(unpack_blocks(receiver.pool.gather(into), LAYOUT, 40), kv)
    assert receiver.blocks_held == 0 and receiver.pool.num_used == 6  # the caller's again
    receiver.pool.free(spare)
    sender.release("t-into")


def test_publish_blocks_leases_the_blocks_as_they_are(sender, receiver):
    """The prefill engine's path: KV already in blocks of the pool is published without a copy;
    the lease holds the blocks from then on (a bad count is refused before it takes them)."""
    kv = make_kv(20, seed=6)
    blocks = sender.pool.allocate(2)
    sender.pool.write(blocks, kv)
    with pytest.raises(ValueError, match="20 tokens are 2 blocks, got 1"):
        sender.publish_blocks("t-blocks", blocks[:1], 20)
    assert sender.debug_state_counts() == {"leases": 0, "used_blocks": 0}
    desc = sender.publish_blocks("t-blocks", blocks, 20)
    assert desc.remote_block_ids == tuple(blocks) and sender.blocks_held == 2
    assert torch.equal(receiver.fetch(desc).kv_canonical, kv)
    assert sender.release("t-blocks") and sender.pool.num_used == 0  # the lease freed them


# -- the same-host path ----------------------------------------------------------------------------


@pytest.fixture
def shared_sender(clock):
    transport = MooncakeTransport()
    s = KVSender(
        "prefill-shm",
        LAYOUT,
        BlockPool(LAYOUT, 32, shared=True),
        transport,
        lease_timeout_s=30.0,
        clock=clock,
    )
    yield s
    assert s.debug_state_counts() == {"leases": 0, "used_blocks": 0}
    s.close()
    assert transport.registered_bytes == 0


def test_same_host_kv_moves_through_shared_memory_and_says_so(shared_sender, transports, caplog):
    kv = make_kv(37, seed=8)
    desc = KVDescriptor.from_params(shared_sender.publish("t-shm", kv).to_params())
    assert desc.shm_path.startswith("/proc/") and desc.host_id
    receivers = {
        mode: KVReceiver(LAYOUT, 16, transports[1] if mode == "auto" else MooncakeTransport(), same_host=mode)
        for mode in ("auto", "off")
    }
    try:
        with caplog.at_level(logging.INFO, logger="omni_pd.kv.handoff"):
            shm = receivers["auto"].fetch(desc)
            again = receivers["auto"].fetch(desc)
        assert shm.path == again.path == "shm" and shm.num_segments == 0
        assert torch.equal(shm.kv_canonical, kv) and torch.equal(again.kv_canonical, kv)
        said = [r.getMessage() for r in caplog.records if "moves through shared memory" in r.getMessage()]
        assert len(said) == 1 and desc.shm_path in said[0]  # once per peer
        tcp = receivers["off"].fetch(desc)  # the negative control: the same KV over Mooncake
        assert tcp.path == "tcp" and tcp.num_segments >= 1 and torch.equal(tcp.kv_canonical, kv)
    finally:
        shared_sender.release("t-shm")
        for receiver in receivers.values():
            receiver.close()


def test_same_host_path_checks_integrity(shared_sender, receiver):
    faults.arm("kv.publish.flip", block_index=1, byte_offset=5, after_checksum=True)
    desc = shared_sender.publish("t-shm-fault", make_kv(40, seed=9))
    try:
        with pytest.raises(KVIntegrityError, match="block 1"):
            receiver.fetch(desc)
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    finally:
        shared_sender.release("t-shm-fault")


def test_same_host_falls_back_or_refuses_with_the_reason(shared_sender, sender, transports, caplog):
    other_host = dataclasses.replace(shared_sender.publish("t-far", make_kv(10)), host_id="another-boot")
    plain = sender.publish("t-plain", make_kv(10))
    insist = KVReceiver(LAYOUT, 16, MooncakeTransport(), same_host="shm")
    auto = KVReceiver(LAYOUT, 16, MooncakeTransport())
    try:
        with caplog.at_level(logging.INFO, logger="omni_pd.kv.handoff"):
            assert auto.fetch(other_host).path == "tcp"
        assert any("runs on another host" in r.getMessage() for r in caplog.records)
        for desc, why in ((other_host, "runs on another host"), (plain, "not shared memory")):
            with pytest.raises(KVTransferError, match=f"kv_same_host is 'shm'.*{why}"):
                insist.fetch(desc)
            assert insist.pool.num_used == 0  # refused before it took any block
        with pytest.raises(ValueError, match="kv_same_host must be one of"):
            KVReceiver(LAYOUT, 4, transports[1], same_host="maybe")
    finally:
        shared_sender.release("t-far")
        sender.release("t-plain")
        insist.close()
        auto.close()


def test_the_cache_checksums_blocks_as_it_writes_them_as_the_sender_would(transports):
    """The prefill engine's fused write + checksum gives the sender's own checksums (so the
    decode side verifies against them), and they see a flipped byte."""
    from omni_pd.engines.core.paged_cache import PagedKVCache

    cache = PagedKVCache(LAYOUT, 8)
    sender = KVSender("prefill-fused", LAYOUT, cache.pool, transports[0], lease_timeout_s=30.0)
    try:
        kv = make_kv(37, seed=10)
        blocks = cache.allocate(37)
        sums = cache.write(blocks, 0, kv, checksums=True)
        theirs = sender.publish_blocks("t-own", blocks, 37)  # checksummed by the sender itself
        assert list(theirs.block_checksums) == sums and len(sums) == 3
        sender.release("t-own")
        blocks = cache.allocate(37)
        cache.write(blocks, 0, kv)
        cache.pool.block_view(blocks[2])[7] ^= 0xFF
        assert sender.publish_blocks("t-flip", blocks, 37).block_checksums[2] != sums[2]
        sender.release("t-flip")
        with pytest.raises(ValueError, match="from position 0"):
            cache.write(cache.allocate(4), 2, kv[:, :, :, :2], checksums=True)
    finally:
        sender.close()
