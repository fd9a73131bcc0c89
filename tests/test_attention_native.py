"""The native decode attention kernel (native/attention.c): it computes what torch's attention
computes, to float tolerance; a sequence's output is bit-identical alone or in any batch, at any
place in it; the cache write lands where the cache keeps that position; bad input is refused.

The engines' own batched-vs-solo tests run with it too (test_thinker_engine.py,
test_talker_batch.py, both kernel paths)."""

import pytest
import torch
import torch.nn.functional as F

from omni_pd.engines.hf import native_build
from omni_pd.engines.hf.attention_native import (
    ATTENTION,
    CacheGeometry,
    DecodeRows,
    check_kernels,
    decode_attention,
)

pytestmark = pytest.mark.exactness

HEADS, KV_HEADS, BLOCK = 4, 2, 8


class Paged:
    """A paged cache like the thinker's: blocks [block, layers, 2, kv_heads, d], float32."""

    def __init__(self, d: int, blocks: int = 64, layers: int = 2, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.d = d
        self.data = torch.randn(blocks, BLOCK, layers, 2, KV_HEADS, d, generator=generator)
        self.geometry = CacheGeometry(
            block=BLOCK,
            block_stride=self.data.stride(0),
            pos_stride=self.data.stride(1),
            head_stride=self.data.stride(4),
        )

    def bases(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.full((count,), self.data[0, 0, layer, 0].data_ptr(), dtype=torch.long),
            torch.full((count,), self.data[0, 0, layer, 1].data_ptr(), dtype=torch.long),
        )

    def kv(self, table: list[int], length: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, length, d] keys and values of a sequence."""
        used = self.data[table, :, layer].flatten(0, 1)[:length]  # [length, 2, kv_heads, d]
        return used[:, 0].transpose(0, 1), used[:, 1].transpose(0, 1)


def _sequences(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Block tables: shuffled, disjoint blocks, enough for each length."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for length in lengths:
        count = -(-length // BLOCK)
        tables.append(order[:count])
        order = order[count:]
    return tables


def _inputs(count: int, d: int, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(count, HEADS, d, generator=generator),
        torch.randn(count, KV_HEADS, d, generator=generator),
        torch.randn(count, KV_HEADS, d, generator=generator),
    )


def _run(cache: Paged, tables, lengths, q, k, v, layer: int = 1) -> torch.Tensor:
    k_bases, v_bases = cache.bases(layer, len(lengths))
    return decode_attention(
        q, k, v, DecodeRows(tables, lengths), k_bases, v_bases, cache.geometry, cache.d**-0.5
    )


@pytest.mark.parametrize("d", [16, 24])  # whole vectors, and a remainder past them
def test_kernel_computes_torch_attention_and_writes_the_new_position(d):
    lengths = [1, 5, 8, 9, 30, 17]
    cache = Paged(d)
    tables = _sequences(lengths)
    q, k, v = _inputs(len(lengths), d)
    out = _run(cache, tables, lengths, q, k, v)
    for b, (table, length) in enumerate(zip(tables, lengths)):
        keys, values = cache.kv(table, length, layer=1)
        assert torch.equal(keys[:, -1], k[b]) and torch.equal(values[:, -1], v[b])
        expected = F.scaled_dot_product_attention(
            q[b : b + 1].unsqueeze(2), keys.unsqueeze(0), values.unsqueeze(0), scale=d**-0.5, enable_gqa=True
        )[0, :, 0]
        assert torch.allclose(out[b], expected, atol=1e-6, rtol=1e-5), b


def test_a_sequence_gets_the_same_bits_alone_and_anywhere_in_any_batch():
    lengths = [3, 40, 12, 1, 25, 7, 16]
    tables = _sequences(lengths)
    q, k, v = _inputs(len(lengths), 16)
    batched = _run(Paged(16), tables, lengths, q, k, v)
    for b in range(len(lengths)):
        alone = _run(Paged(16), [tables[b]], [lengths[b]], q[b : b + 1], k[b : b + 1], v[b : b + 1])
        assert torch.equal(alone[0], batched[b]), b
    order = list(reversed(range(len(lengths))))
    reordered = _run(
        Paged(16),
        [tables[i] for i in order],
        [lengths[i] for i in order],
        q[order].contiguous(),
        k[order].contiguous(),
        v[order].contiguous(),
    )
    assert torch.equal(reordered, batched[order])


def test_negative_control_a_changed_key_moves_only_its_own_sequence():
    lengths = [6, 20, 11]
    tables = _sequences(lengths)
    q, k, v = _inputs(len(lengths), 16)
    before = _run(Paged(16), tables, lengths, q, k, v)
    cache = Paged(16)
    block, offset = tables[1][1], 2  # position 10 of sequence 1, layer 1, kv head 0
    cache.data[block, offset, 1, 0, 0, 0] += 1e-3
    after = _run(cache, tables, lengths, q, k, v)
    assert not torch.equal(after[1], before[1])
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])


def test_contiguous_per_sequence_caches_as_the_talker_keeps_them():
    """One block as long as the cache, token-major [capacity, kv_heads, d], a tensor each."""
    generator = torch.Generator().manual_seed(3)
    lengths = [4, 9]
    keys = [torch.randn(16, KV_HEADS, 16, generator=generator) for _ in lengths]
    values = [torch.randn(16, KV_HEADS, 16, generator=generator) for _ in lengths]
    q, k, v = _inputs(len(lengths), 16)
    geometry = CacheGeometry(block=1 << 40, block_stride=0, pos_stride=KV_HEADS * 16, head_stride=16)
    out = decode_attention(
        q,
        k,
        v,
        DecodeRows([[0], [0]], lengths),
        torch.tensor([t.data_ptr() for t in keys]),
        torch.tensor([t.data_ptr() for t in values]),
        geometry,
        0.25,
    )
    for b, n in enumerate(lengths):
        assert torch.equal(keys[b][n - 1], k[b]) and torch.equal(values[b][n - 1], v[b])
        expected = F.scaled_dot_product_attention(
            q[b : b + 1].unsqueeze(2),
            keys[b][:n].transpose(0, 1).unsqueeze(0),
            values[b][:n].transpose(0, 1).unsqueeze(0),
            scale=0.25,
            enable_gqa=True,
        )[0, :, 0]
        assert torch.allclose(out[b], expected, atol=1e-6, rtol=1e-5)


def test_bad_input_is_refused():
    cache = Paged(16)
    lengths = [3, 4]
    tables = _sequences(lengths)
    q, k, v = _inputs(2, 16)
    with pytest.raises(ValueError, match="contiguous float32"):
        _run(cache, tables, lengths, q.double(), k, v)
    with pytest.raises(ValueError, match="3 query rows for a step of 2 sequences"):
        _run(cache, tables, lengths, *_inputs(3, 16))
    with pytest.raises(ValueError, match="attention_kernels must be one of native, torch, not 'fast'"):
        check_kernels("fast")


def test_without_a_compiler_the_error_names_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_PD_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(
        native_build.NativeBuildError,
        match="no C compiler found for the attention kernels.*attention_kernels: torch",
    ):
        native_build.build(ATTENTION)
