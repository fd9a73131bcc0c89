"""The tiled linear layer gives a row the same bits whatever else is in its batch; plain
F.linear does not (the reason the tiles exist)."""
import torch
import torch.nn.functional as F

from omni_pd.engines.hf import batch_invariant as bi

SHAPES = [(64, 1024), (64, 64), (64, 32), (32, 1152), (64, 272), (16, 64), (32, 1)]


def _rows(count, width, seed):
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))


def test_a_row_is_the_same_alone_and_anywhere_in_any_batch():
    for index, (k, n) in enumerate(SHAPES):
        weight = _rows(n, k, index)
        row = _rows(1, k, 100 + index)
        alone = bi.linear(row, weight)[0]
        for size in (2, 3, 5, 8, 16, 17, 40, 64):
            for position in {0, size // 2, size - 1}:
                batch = _rows(size, k, 1000 * size + position)
                batch[position] = row[0]
                assert torch.equal(bi.linear(batch, weight)[position], alone), (k, n, size, position)


def test_leading_dimensions_and_bias_are_kept():
    weight, bias, x = _rows(8, 4, 1), _rows(1, 8, 2)[0], _rows(6, 4, 3).view(2, 3, 4)
    out = bi.linear(x, weight, bias)
    assert out.shape == (2, 3, 8)
    assert torch.allclose(out, F.linear(x, weight, bias), atol=1e-6)


def test_negative_control_plain_linear_depends_on_the_batch():
    """What the tiles fix: the same row computed alone and inside a batch by plain F.linear
    differs in the last bits for some of these shapes on this CPU (gemv vs gemm kernels)."""
    differs = []
    for index, (k, n) in enumerate(SHAPES):
        weight, batch = _rows(n, k, index), _rows(16, k, 50 + index)
        differs.append(not torch.equal(F.linear(batch[:1], weight)[0], F.linear(batch, weight)[0]))
        with bi.disabled():
            assert torch.equal(bi.linear(batch[:1], weight), F.linear(batch[:1], weight))
    assert any(differs)


def test_experts_give_a_row_the_same_bits_whatever_the_other_rows_picked(tiny_model):
    """Every expert runs on every row in a batched step, weighted 0 where not routed: a row's
    output is the same alone and among rows routed elsewhere, and it is the routed sum (the
    per-expert path the negative control uses) up to the last bits."""
    block = tiny_model.thinker.model.layers[0].mlp
    width = block.experts.gate_up_proj.shape[-1]
    row = _rows(1, width, 7)
    with torch.no_grad():
        weights, index = bi.route(block.gate, row)
        alone = bi.experts(block.experts, row, index, weights)
        for size in (2, 5, 16, 17, 33):
            batch = _rows(size, width, 300 + size)
            batch[size // 2] = row[0]
            w, i = bi.route(block.gate, batch)
            assert len(set(i.flatten().tolist())) > index.numel()  # others picked other experts
            assert torch.equal(bi.experts(block.experts, batch, i, w)[size // 2], alone[0]), size
        with bi.disabled():
            routed = bi.experts(block.experts, row, index, weights)
    assert torch.allclose(alone, routed, rtol=1e-5, atol=1e-7)


def test_prompt_attention_rows_do_not_depend_on_the_call():
    """`attend_rows`: a row's bits are the same whether its prompt is computed whole, from a
    cached prefix on (any start), or as the prefix of a longer prompt; and they are attention
    (to float tolerance against torch's). Negative control: torch's fused attention is not."""
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(3)
    n = 300
    q = torch.randn(1, 4, n, 32, generator=gen)
    k = torch.randn(1, 2, n, 32, generator=gen)
    v = torch.randn(1, 2, n, 32, generator=gen)
    longest = bi.attend_rows(q, k, v, 0.2, 0)
    for length in (1, 17, 64, 65, 231):
        whole = bi.attend_rows(q[:, :, :length], k[:, :, :length], v[:, :, :length], 0.2, 0)
        assert torch.equal(whole, longest[:length]), length
        for start in (c for c in (3, 16, 64, 200) if c < length):
            rest = bi.attend_rows(q[:, :, start:length], k[:, :, :length], v[:, :, :length], 0.2, start)
            assert torch.equal(rest, whole[start:]), (length, start)
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    fused = fused[0].transpose(0, 1).reshape(n, -1)
    assert torch.allclose(fused, longest, atol=1e-5)
    shorter = F.scaled_dot_product_attention(q[:, :, :231], k[:, :, :231], v[:, :, :231],
                                             is_causal=True, scale=0.2, enable_gqa=True)
    assert not torch.equal(shorter[0].transpose(0, 1).reshape(231, -1), fused[:231])
