"""The KV plane's GPU paths, as far as they run on a CPU (issue 30): device checksums, the
host staging of a pool that Mooncake cannot read (exercised with host pools), the choice of
the same-host path, and the CUDA IPC module's refusals. The GPU itself: tests/test_gpu.py."""

import dataclasses
import logging
import os

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from omni_pd.kv import (
    BlockLayout,
    KVDescriptor,
    KVIntegrityError,
    KVReceiver,
    KVSender,  # noqa: E402
    KVTransferError,
    MooncakeTransport,
)
from omni_pd.kv.transport import cuda_ipc  # noqa: E402
from omni_pd.kv.checksum import checksum, checksums, kind_for, wsum64  # noqa: E402
from omni_pd.kv.pool import BlockPool  # noqa: E402

LAYOUT = BlockLayout.default_for(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16)


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, num_tokens, 16, generator=g)


@pytest.fixture(scope="module")
def transports():
    return MooncakeTransport(), MooncakeTransport()


# -- device checksums ------------------------------------------------------------------------------


def test_wsum64_sees_every_single_bit_flip_and_the_length():
    data = torch.randint(0, 256, (96,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = wsum64(data)
    seen = set()
    for byte in range(data.numel()):
        for bit in range(8):
            flipped = data.clone()
            flipped[byte] ^= 1 << bit
            seen.add(wsum64(flipped))
    assert base not in seen and len(seen) == 96 * 8  # every flip, each to its own value
    # Two changes do not cancel (in a plain weighted sum two flipped top bits would).
    both = data.clone()
    both[7] ^= 0x80
    both[15] ^= 0x80
    assert wsum64(both) != base
    # Zero padding does not hide a length change; the kind is by name.
    assert wsum64(torch.zeros(8, dtype=torch.uint8)) != wsum64(torch.zeros(16, dtype=torch.uint8))
    assert checksum(data, "wsum64") == base and checksum(data, "xxh3") != base
    with pytest.raises(ValueError, match="checksum kind must be one of"):
        checksum(data, "crc32")


def test_wsum64_does_not_depend_on_where_the_bytes_lie():
    """A view at an odd address, a copy, a long buffer past the first table of weights: the
    same bytes give the same sum (the GPU and the CPU compute it the same way: integer sums do
    not depend on the reduction order)."""
    big = torch.randint(
        0, 256, (3 * 4096 * 8 + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    view = big[5:]
    assert view.data_ptr() % 8
    assert wsum64(view) == wsum64(view.clone())
    assert wsum64(big[: 4096 * 8]) != wsum64(big[8 : 4096 * 8 + 8])  # positions count
    assert kind_for("cpu") == "xxh3" and kind_for("cuda:0") == "wsum64"


def test_wsum64_of_host_bytes_holds_when_another_device_is_torchs_default(monkeypatch):
    """A stage worker on a GPU makes that GPU torch's default device (engines/device.py); a host
    pool's checksums must still be computed on the host. The meta device stands in for the GPU
    here: a tensor made without a device would land there and meet the host's weights. (The
    first GPU run found this: "indices should be either on cpu or on the same device".)"""
    from omni_pd.kv import checksum as checksum_module

    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    want = wsum64(data)
    monkeypatch.setattr(checksum_module, "_weights", {})  # the weights are made anew
    torch.set_default_device("meta")
    try:
        got = wsum64(data)
    finally:
        torch.set_default_device(None)
    assert got == want


def test_wsum64_of_many_blocks_at_once_is_each_blocks_own():
    """`checksums` takes a GPU pool's blocks in one pass and one sync: each value is the block's
    own wsum64, with full blocks, a shorter last one, a length that is no whole number of words
    and a view that starts off an 8-byte boundary; one flipped byte moves that block's alone."""
    gen = torch.Generator().manual_seed(9)
    pool = torch.randint(0, 256, (8 * 512 + 3,), dtype=torch.uint8, generator=gen)
    views = [pool[i * 512 : (i + 1) * 512] for i in range(6)] + [pool[3072:3372], pool[3373:3500]]
    views.append(pool[3501 : 3501 + 512])  # 512 bytes, but off an 8-byte boundary
    want = [wsum64(v) for v in views]
    assert checksums(views, "wsum64") == want
    assert checksums(views, "xxh3") == [checksum(v, "xxh3") for v in views]
    views[2][100] ^= 1
    got = checksums(views, "wsum64")
    assert [i for i, (a, b) in enumerate(zip(got, want)) if a != b] == [2]


def test_a_descriptor_names_its_checksum_kind_and_the_receiver_uses_it(transports):
    sender = KVSender("prefill-kind", LAYOUT, 16, transports[0], lease_timeout_s=30.0)
    receiver = KVReceiver(LAYOUT, 16, transports[1])
    try:
        kv = make_kv(40, seed=3)
        desc = sender.publish("t-kind", kv)
        assert desc.checksum_kind == "xxh3" and "checksum_kind" not in desc.to_params()
        lengths = LAYOUT.transfer_lengths(40)
        device_sums = tuple(
            wsum64(sender.pool.block_view(b)[:n]) for b, n in zip(desc.remote_block_ids, lengths)
        )
        as_gpu = dataclasses.replace(desc, checksum_kind="wsum64", block_checksums=device_sums)
        again = KVDescriptor.from_params(as_gpu.to_params())
        assert again.checksum_kind == "wsum64" and again == as_gpu
        assert torch.equal(receiver.fetch(again).kv_canonical, kv)
        # Negative control: xxh3 values read as device sums do not verify.
        with pytest.raises(KVIntegrityError, match="block 0"):
            receiver.fetch(dataclasses.replace(desc, checksum_kind="wsum64"))
        with pytest.raises(ValueError, match="checksum_kind"):
            KVDescriptor.from_params({**desc.to_params(), "checksum_kind": "md5"})
    finally:
        sender.release("t-kind")
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
        sender.close()
        receiver.close()


# -- host staging (a GPU pool's path over a Mooncake that cannot read GPU memory) --------------------


def test_pools_copy_blocks_run_by_run():
    a, b = BlockPool(LAYOUT, 8), BlockPool(LAYOUT, 8)
    # Every byte of `a` set (fresh pool memory is uninitialised and may happen to be zeros).
    a.memory().copy_(
        torch.randint(1, 256, (a.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    )
    b.memory().zero_()
    b.copy_blocks_from(a, [4, 1, 2])
    for i in range(8):
        assert torch.equal(b.block_view(i), a.block_view(i)) == (i in (1, 2, 4))
    with pytest.raises(ValueError, match="outside"):
        b.copy_blocks_from(a, [8])


def test_staged_handoff_moves_the_host_copy_and_lands_in_the_pool(transports, caplog):
    """Both sides stage (as GPU pools do with a CPU-only Mooncake): the sender copies what it
    publishes into its host copy, which is what Mooncake reads; the receiver reads into its
    host copy and copies the blocks up into its pool."""
    sender = KVSender("prefill-staged", LAYOUT, 16, transports[0], lease_timeout_s=30.0, host_staging=True)
    receiver = KVReceiver(LAYOUT, 16, transports[1], host_staging=True)
    try:
        assert sender.landing is not sender.pool and receiver.landing is not receiver.pool
        assert transports[0].registered_bytes == sender.landing.nbytes  # the copy, not the pool
        kv = make_kv(37, seed=5)
        desc = sender.publish("t-staged", kv)
        assert desc.remote_base_address == sender.landing.base_address
        # After publish the pool may change (it is the engine's cache): the copy was taken.
        sender.pool.block_view(desc.remote_block_ids[0])[:64] = 0
        blocks = receiver.pool.allocate(receiver.dest_blocks(desc))
        receiver.start(desc, into=blocks)
        while (result := receiver.poll("t-staged")) is None:
            pass
        assert result.path == "tcp" and result.blocks == blocks
        assert torch.equal(receiver.pool.read(blocks, 37), kv)  # in the pool, not only the copy
        receiver.pool.free(blocks)
        sender.release("t-staged")
        # Negative control: the host copy is what travels, so a change to it is caught.
        desc = sender.publish("t-staged-bad", make_kv(20, seed=6))
        sender.landing.block_view(desc.remote_block_ids[1])[3] ^= 0xFF
        with pytest.raises(KVIntegrityError, match="block 1"):
            receiver.fetch(desc)
        sender.release("t-staged-bad")
    finally:
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
        sender.close()
        receiver.close()
    assert transports[0].registered_bytes == transports[1].registered_bytes == 0
    with pytest.raises(ValueError, match="kv_buffer_device must be"):
        KVReceiver(LAYOUT, 4, transports[1], buffer_device="tpu")


# -- the same-host path's choice -------------------------------------------------------------------


def test_insisting_on_cuda_ipc_between_host_pools_names_the_path(transports):
    sender = KVSender(
        "prefill-shm2", LAYOUT, BlockPool(LAYOUT, 16, shared=True), transports[0], lease_timeout_s=30.0
    )
    insist = KVReceiver(LAYOUT, 16, transports[1], same_host="cuda_ipc")
    try:
        desc = sender.publish("t-ipc", make_kv(10, seed=7))
        assert desc.cuda_ipc is None and desc.shm_path  # a host pool offers shared memory
        with pytest.raises(
            KVTransferError, match="kv_same_host is 'cuda_ipc'.*path between these pools is 'shm'"
        ):
            insist.fetch(desc)
        assert insist.pool.num_used == 0
        sender.release("t-ipc")
    finally:
        sender.close()
        insist.close()


def test_a_gpu_peer_is_read_over_mooncake_by_a_host_pool(transports, caplog):
    """A descriptor that offers only a CUDA IPC handle (a GPU prefill pool) and a receiver whose
    pool is in host memory: Mooncake, said once, with the reason."""
    sender = KVSender("prefill-fake-gpu", LAYOUT, 16, transports[0], lease_timeout_s=30.0)
    receiver = KVReceiver(LAYOUT, 16, transports[1])
    try:
        kv = make_kv(21, seed=8)
        desc = dataclasses.replace(
            sender.publish("t-gpu-peer", kv), cuda_ipc='{"uuid": "GPU-x"}', host_id="same"
        )
        with caplog.at_level(logging.INFO, logger="omni_pd.kv.handoff"):
            result = receiver.fetch(desc)
        assert result.path == "tcp" and torch.equal(result.kv_canonical, kv)
        assert any(
            "its pool is on a GPU and this engine's is in host memory" in r.getMessage()
            for r in caplog.records
        )
        sender.release("t-gpu-peer")
    finally:
        sender.close()
        receiver.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a host without CUDA")
def test_cuda_ipc_refuses_by_name_without_cuda():
    assert cuda_ipc.supported() == "no CUDA device is visible"
    with pytest.raises(ValueError, match="contiguous uint8 CUDA tensor"):
        cuda_ipc.export_handle(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(OSError, match="CUDA IPC is not available: no CUDA device is visible"):
        cuda_ipc.open_handle("{}")
    assert BlockPool(LAYOUT, 2).cuda_ipc_handle is None  # a host pool has none
