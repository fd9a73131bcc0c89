"""The MoE experts kernel (native/experts.c): a row's bits are the same alone and anywhere in any
batch, whatever experts the other rows picked and however many threads run; it is the routed sum
to float tolerance; the plain routed products (the negative control) are not batch-invariant.
The torch form of the same contract (16-row tiles) is held to the same test."""

import copy

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qwen3_omni
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

from omni_pd.engines.hf import batch_invariant as bi

pytestmark = pytest.mark.exactness

# Widths that are not whole vectors of 16 (the kernel's tails), 24 experts (about 2.5 MiB: past
# the every-expert form's bound), top-4.
HIDDEN, INTER, EXPERTS, TOP = 200, 72, 24, 4


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    config = Qwen3OmniMoeTextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP,
        moe_intermediate_size=INTER,
        norm_topk_prob=True,
    )
    module = qwen3_omni.Qwen3OmniMoeThinkerTextSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.1)
    return module


def _rows(count, seed):
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_the_forms_follow_shape_dtype_and_kernels(block, tiny_model, monkeypatch):
    assert bi.experts_form(block.experts, "native") == "native"
    assert bi.experts_form(block.experts, "torch") == "tiles"
    assert bi.experts_form(tiny_model.thinker.model.layers[0].mlp.experts, "native") == "every"
    half = copy.deepcopy(block).to(torch.bfloat16)
    monkeypatch.setattr(bi, "EVERY_EXPERT_MAX_BYTES", 0)  # half the bytes: past the bound again
    assert bi.experts_form(half.experts, "native") == "tiles"  # the kernel is float32 only


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_a_row_is_the_same_alone_and_in_any_batch(block, kernels):
    row = _rows(1, 7)
    with torch.no_grad():
        weights, index = bi.route(block.gate, row)
        alone = bi.experts(block.experts, row, index, weights, kernels)
        for size in (2, 3, 5, 8, 16, 17, 40):
            for position in {0, size // 2, size - 1}:
                batch = _rows(size, 100 * size + position)
                batch[position] = row[0]
                w, i = bi.route(block.gate, batch)
                assert len(set(i.flatten().tolist())) > TOP  # others picked other experts
                out = bi.experts(block.experts, batch, i, w, kernels)
                assert torch.equal(out[position], alone[0]), (kernels, size, position)
        with bi.disabled():
            routed = bi.experts(block.experts, row, index, weights, kernels)
    assert torch.allclose(alone, routed, rtol=1e-4, atol=1e-6)


def test_the_thread_count_does_not_change_the_bits(block):
    batch = _rows(33, 3)
    threads = torch.get_num_threads()
    with torch.no_grad():
        w, i = bi.route(block.gate, batch)
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            try:
                results.append(bi.experts(block.experts, batch, i, w, "native"))
            finally:
                torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_negative_control_plain_routed_products_depend_on_the_batch(block):
    """What the kernel and the tiles fix: an expert's plain product on a row alone and on the
    same row among others differs in the last bits for some rows on this CPU."""
    batch = _rows(40, 11)
    differs = []
    with torch.no_grad(), bi.disabled():
        w, i = bi.route(block.gate, batch)
        together = bi.experts(block.experts, batch, i, w)
        for r in range(batch.shape[0]):
            alone = bi.experts(block.experts, batch[r : r + 1], i[r : r + 1], w[r : r + 1])
            differs.append(not torch.equal(alone[0], together[r]))
    assert any(differs)
