import pytest
import torch

from omni_pd.kv import BlockLayout, BlockPool, PoolExhausted

LAYOUT = BlockLayout.default_for(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def test_buffer_is_aligned_and_addresses_are_strided():
    pool = BlockPool(LAYOUT, 8)
    assert pool.base_address % 64 == 0
    assert pool.nbytes == 8 * LAYOUT.block_bytes
    assert pool.block_address(3) == pool.base_address + 3 * LAYOUT.block_bytes
    assert pool.block_view(3).data_ptr() == pool.block_address(3)


def test_allocate_free_counts():
    pool = BlockPool(LAYOUT, 8)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 5
    pool.free(a)
    assert pool.num_used == 0 and pool.num_free == 8


def test_exhaustion_message_names_counts_and_key():
    pool = BlockPool(LAYOUT, 4)
    pool.allocate(3)
    with pytest.raises(PoolExhausted, match=r"2 blocks requested, 1 of 4 free.*kv_pool_blocks"):
        pool.allocate(2)
    assert pool.num_used == 3  # a failed allocation takes nothing


def test_double_free_is_an_error_and_changes_nothing():
    pool = BlockPool(LAYOUT, 4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a + b)
    assert pool.num_used == 1
    with pytest.raises(ValueError, match="outside"):
        pool.free([7])


def test_prefers_lowest_contiguous_run():
    pool = BlockPool(LAYOUT, 10)
    a, b, c = pool.allocate(2), pool.allocate(3), pool.allocate(2)
    assert (a, b, c) == ([0, 1], [2, 3, 4], [5, 6])
    pool.free(a)
    # Holes: [0, 1] and [7, 8, 9]; 3 blocks fit only in the upper run.
    assert pool.allocate(3) == [7, 8, 9]
    assert pool.allocate(1) == [0]


def test_fragmented_allocation_falls_back_to_lowest_ids():
    pool = BlockPool(LAYOUT, 6)
    ids = [pool.allocate(1)[0] for _ in range(6)]
    pool.free([ids[1], ids[3], ids[5]])
    assert pool.allocate(3) == [1, 3, 5]


def test_write_read_round_trip_in_scattered_blocks():
    pool = BlockPool(LAYOUT, 6)
    kv = torch.randn(2, 2, 2, 9, 4)
    ids = [5, 1, 3]
    pool.write(ids, kv)
    assert torch.equal(pool.read(ids, 9), kv)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        pool.write([0, 2], kv)
