"""The tiled linear layer gives a row the same bits whatever else is in its batch; plain
F.linear does not (the reason the tiles exist)."""

import pytest
import torch
import torch.nn.functional as F

from omni_pd.engines.hf import batch_invariant as bi

pytestmark = pytest.mark.exactness

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
    q, k, v = check_attention_rows("cpu")
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    shorter = F.scaled_dot_product_attention(
        q[:, :, :231], k[:, :, :231], v[:, :, :231], is_causal=True, scale=0.2, enable_gqa=True
    )
    assert not torch.equal(shorter, fused[:, :, :231])


def check_attention_rows(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of the test above on `device` (tests/test_gpu.py runs it on cuda:0, as a stage
    worker does: that device torch's default)."""
    gen = torch.Generator().manual_seed(3)
    n = 300
    q, k, v = (torch.randn(1, h, n, 32, generator=gen, device="cpu").to(device) for h in (4, 2, 2))
    with torch.device(device):
        _attention_rows(q, k, v, n)
    return q, k, v


def _attention_rows(q, k, v, n) -> None:
    longest = bi.attend_rows(q, k, v, 0.2, 0)
    for length in (1, 17, 64, 65, 231, n):
        whole = bi.attend_rows(q[:, :, :length], k[:, :, :length], v[:, :, :length], 0.2, 0)
        assert torch.equal(whole, longest[:length]), length
        for start in (c for c in (3, 16, 64, 200, 288) if c < length):
            rest = bi.attend_rows(q[:, :, start:length], k[:, :, :length], v[:, :, :length], 0.2, start)
            assert torch.equal(rest, whole[start:]), (length, start)
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    fused = fused[0].transpose(0, 1).reshape(n, -1)
    assert torch.allclose(fused, longest, atol=1e-5)


# -- elementwise ops: an element's bits must not depend on where it sits in its tensor ---------

_LENGTHS = list(range(1, 97)) + [255, 1000, 4097, 32767, 32769, 70001]


def _position_dependent(op, threads_list=(1, 2)) -> list[tuple[int, int, int]]:
    """(threads, length, offset) for which `op` on a slice of a tensor differs from the same
    elements of `op` on the whole tensor (torch splits big tensors across threads, and each
    chunk has a tail of its own)."""
    values = torch.randn(80000, generator=torch.Generator().manual_seed(5)) * 4
    found = []
    before = torch.get_num_threads()
    try:
        for threads in threads_list:
            torch.set_num_threads(threads)
            whole = op(values)
            for length in _LENGTHS:
                for offset in (0, 3, 17):
                    if not torch.equal(op(values[offset : offset + length]), whole[offset : offset + length]):
                        found.append((threads, length, offset))
    finally:
        torch.set_num_threads(before)
    return found


def test_the_engines_activations_are_position_invariant_on_this_cpu():
    """The forms the engines use give an element the same bits at any position of a tensor of
    any length, on any thread count, under this host's ATen dispatch (CI runs this file under
    the default dispatch and under ATEN_CPU_CAPABILITY=avx2)."""
    for name, op in {"silu": bi.silu, "sigmoid": bi.sigmoid}.items():
        assert _position_dependent(op) == [], name
    assert torch.allclose(
        bi.silu(torch.linspace(-30, 30, 601)), F.silu(torch.linspace(-30, 30, 601)), atol=1e-6, rtol=1e-6
    )
    assert torch.allclose(
        bi.sigmoid(torch.linspace(-30, 30, 601)),
        torch.sigmoid(torch.linspace(-30, 30, 601)),
        atol=1e-7,
        rtol=1e-6,
    )


def test_rms_norm_and_rotary_are_row_count_invariant(tiny_model):
    """transformers' RMSNorm and the rotary tables, which the engines call as they are."""
    layer = tiny_model.thinker.model.layers[0]
    norm = layer.input_layernorm
    width = norm.weight.shape[0]
    rows = _rows(300, width, 11)
    rotary = tiny_model.thinker.model.rotary_emb
    with torch.no_grad():
        whole = norm(rows)
        cos, sin = rotary(rows.unsqueeze(0), torch.arange(300).view(1, 1, -1).expand(3, 1, -1))
        for count in list(range(1, 40)) + [127, 255]:
            assert torch.equal(norm(rows[:count]), whole[:count]), count
            c, s = rotary(rows[:count].unsqueeze(0), torch.arange(count).view(1, 1, -1).expand(3, 1, -1))
            assert torch.equal(c, cos[:, :count]) and torch.equal(s, sin[:, :count]), count


def test_negative_control_torch_sigmoid_and_silu_depend_on_position():
    """What `bi.silu` / `bi.sigmoid` fix: torch's own kernels compute a tensor's tail with a
    scalar formula that differs in the last bit for some inputs (seen on AVX2 and AVX-512)."""
    dependent = _position_dependent(F.silu, threads_list=(1,)) + _position_dependent(
        torch.sigmoid, threads_list=(1,)
    )
    if not dependent:
        pytest.skip(
            f"torch's sigmoid/SiLU are position-invariant under {torch.backends.cpu.get_cpu_capability()}"
        )
    assert dependent


def test_an_activation_without_an_exact_form_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="activation GELU"):
        bi.activation(torch.nn.GELU())
    with pytest.raises(NotImplementedError, match="activation Tanh"):
        bi.check_activations(torch.nn.Sequential(_WithAct(torch.nn.Tanh())))
    bi.check_activations(torch.nn.Sequential(_WithAct(torch.nn.SiLU())))


class _WithAct(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act_fn = act
