"""The engine's one attention call (engines/core/attention.py) on the hf backend, without a model:
a prompt's rows over a cached prefix are the whole prompt's rows to the bit, prompts in one pass
are each alone's, a decode step writes each new key and value into the sequence's next slot, and
the native kernel and torch's agree behind the same call. Each equality has a negative control."""

from __future__ import annotations

import pytest
import torch

from omni_pd.engines.core.attention import SequenceSlot, StepAttention
from omni_pd.engines.core.paged_cache import PagedKVCache
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.kv import BlockLayout

LAYERS, HEADS, KV_HEADS, HD, BLOCK = 2, 4, 2, 16, 8
LAYOUT = BlockLayout.default_for(LAYERS, KV_HEADS, HD, "float32", block_size=BLOCK)
SCALE = HD**-0.5


def _rows(count: int, heads: int, seed: int) -> torch.Tensor:
    return torch.randn(count, heads, HD, generator=torch.Generator().manual_seed(seed))


def _qkv(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rows(count, HEADS, seed), _rows(count, KV_HEADS, seed + 1), _rows(count, KV_HEADS, seed + 2)


def _prefill(cache, slots, q, k, v, layer=0, prompt_attention="row_invariant"):
    attention = StepAttention.for_prefill(HfCompute("torch"), cache, slots, prompt_attention)
    return attention(layer, q, k, v, SCALE), attention


def test_a_prompt_over_its_cached_prefix_computes_the_whole_prompts_rows():
    cache = PagedKVCache(LAYOUT, 8)
    n, cached = 21, 16  # two full blocks cached, five positions computed
    blocks = cache.allocate(n)
    q, k, v = _qkv(n, 0)
    whole, attention = _prefill(cache, [SequenceSlot(blocks, 0, n)], q, k, v)
    # The cached prefix's KV, as the engine writes a prefill's KV (every layer the same here).
    kv = attention.prompt_kv(0)  # [1 layer, 2, kv_heads, n, hd]
    cache.write(blocks, 0, kv[:, :, :, :cached].expand(LAYERS, -1, -1, -1, -1).contiguous())
    rest, _ = _prefill(cache, [SequenceSlot(blocks, cached, n - cached)], q[cached:], k[cached:], v[cached:])
    assert torch.equal(rest, whole[cached:])
    # Negative control: one cached key moved, the rows over it move.
    cache.data[blocks[0], 3, 0, 0, 0, 0] += 1.0
    moved, _ = _prefill(cache, [SequenceSlot(blocks, cached, n - cached)], q[cached:], k[cached:], v[cached:])
    assert not torch.equal(moved, whole[cached:])


@pytest.mark.parametrize("prompt_attention", ["row_invariant", "fused"])
def test_prompts_in_one_pass_are_each_alone(prompt_attention):
    lengths = [5, 17, 1]
    qkv = [_qkv(n, 10 * i) for i, n in enumerate(lengths)]
    alone = [
        _prefill(None, [SequenceSlot([], 0, n)], *t, prompt_attention=prompt_attention)
        for n, t in zip(lengths, qkv)
    ]
    together, attention = _prefill(
        None,
        [SequenceSlot([], 0, n) for n in lengths],
        *(torch.cat([t[j] for t in qkv]) for j in range(3)),
        prompt_attention=prompt_attention,
    )
    assert torch.equal(together, torch.cat([out for out, _ in alone]))
    for i, (_, solo) in enumerate(alone):
        assert torch.equal(attention.prompt_kv(i), solo.prompt_kv(0))
    # Negative control: the slots' lengths decide which rows attend to which; another split
    # of the same rows gives other outputs.
    resplit, _ = _prefill(
        None,
        [SequenceSlot([], 0, n) for n in (6, 16, 1)],
        *(torch.cat([t[j] for t in qkv]) for j in range(3)),
        prompt_attention=prompt_attention,
    )
    assert not torch.equal(resplit, together)


def _decode(kernels: str, cache, slots, q, k, v, layer=1):
    attention = StepAttention.for_decode(HfCompute(kernels), cache, slots)
    return attention(layer, q, k, v, SCALE), attention


def test_a_decode_step_writes_each_new_position_and_both_kernels_agree():
    outs, caches = {}, {}
    positions = [12, 3]
    q, k, v = _qkv(2, 40)
    for kernels in ("native", "torch"):
        cache = PagedKVCache(LAYOUT, 8)
        tables = [cache.allocate(p + 1) for p in positions]
        history = _rows(16, KV_HEADS, 7)
        for table, p in zip(tables, positions):  # the same earlier keys/values in every layer
            cache.write(table, 0, history[:p].permute(1, 0, 2).expand(LAYERS, 2, -1, -1, -1).contiguous())
        slots = [SequenceSlot(t, p, 1) for t, p in zip(tables, positions)]
        outs[kernels], _ = _decode(kernels, cache, slots, q, k, v)
        caches[kernels] = (cache, tables)
        for b, (table, p) in enumerate(zip(tables, positions)):
            stored = cache.read(table, p + 1)  # [layers, 2, kv_heads, p + 1, hd]
            assert torch.equal(stored[1, 0, :, p], k[b]) and torch.equal(stored[1, 1, :, p], v[b])
    assert outs["native"].shape == (2, HEADS * HD)
    assert torch.allclose(outs["native"], outs["torch"], atol=1e-6)
    # Negative control: an earlier key moved in one sequence's cache moves that row only.
    cache, tables = caches["torch"]
    cache.data[tables[0][0], 0, 1, 0, 0, 0] += 1.0
    slots = [SequenceSlot(t, p, 1) for t, p in zip(tables, positions)]
    moved, _ = _decode("torch", cache, slots, q, k, v)
    assert not torch.allclose(moved[0], outs["torch"][0], atol=1e-6)
    assert torch.equal(moved[1], outs["torch"][1])


def test_select_is_the_same_step_for_some_sequences_and_shapes_are_checked():
    cache = PagedKVCache(LAYOUT, 8)
    tables = [cache.allocate(4) for _ in range(3)]
    # The pool is uninitialised memory: write each sequence's two earlier positions, or the
    # step reads whatever bytes were there (NaN now and then, and NaN != NaN).
    for i, table in enumerate(tables):
        history = _rows(2, KV_HEADS, 51 + i).permute(1, 0, 2)
        cache.write(table, 0, history.expand(LAYERS, 2, -1, -1, -1).contiguous())
    q, k, v = _qkv(3, 50)
    step = StepAttention.for_decode(HfCompute("native"), cache, [SequenceSlot(t, 2, 1) for t in tables])
    full = step(0, q, k, v, SCALE)
    part = step.select([0, 2])(0, q[[0, 2]], k[[0, 2]], v[[0, 2]], SCALE)
    assert torch.equal(part, full[[0, 2]])
    # Negative control: selecting another sequence reads its cache, not the one asked for.
    other = step.select([0, 1])(0, q[[0, 2]], k[[0, 2]], v[[0, 2]], SCALE)
    assert torch.equal(other[0], full[0]) and not torch.equal(other[1], full[2])
    with pytest.raises(ValueError, match="for a step of 3 new positions"):
        step(0, q[:2], k[:2], v[:2], SCALE)
    with pytest.raises(ValueError, match="one new position per sequence"):
        StepAttention.for_decode(HfCompute("torch"), cache, [SequenceSlot(tables[0], 2, 2)])
    with pytest.raises(ValueError, match="no cached prefix"):
        StepAttention.for_prefill(HfCompute("torch"), cache, [SequenceSlot(tables[0], 8, 1)], "fused")
