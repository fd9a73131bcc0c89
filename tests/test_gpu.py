"""hf stages and the KV handoff on a CUDA GPU (issue 30). Every test here is marked `gpu` and
skips where torch sees no CUDA device; scripts/gpu_check.sh runs them where one is lent.

What runs on the CPU instead: tests/test_devices.py (placement and refusals) and
tests/test_kv_device_paths.py (device checksums, host staging, the same-host path's choice)."""

import multiprocessing
import os

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from omni_pd.kv import BlockLayout, KVDescriptor, KVIntegrityError, KVReceiver, KVSender, MooncakeTransport  # noqa: E402
from omni_pd import faults  # noqa: E402
from omni_pd.kv.checksum import checksum, wsum64  # noqa: E402
from omni_pd.kv.pool import BlockPool  # noqa: E402

pytestmark = pytest.mark.gpu
GPU = "cuda:0"
LAYOUT = BlockLayout.default_for(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16)


def make_kv(num_tokens: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, 2, num_tokens, 16, generator=g).to(device)


def test_a_gpu_pool_checksums_its_blocks_on_the_device_as_the_host_would():
    pool = BlockPool(LAYOUT, 8, device=GPU)
    assert pool.checksum_kind == "wsum64" and pool.memory().is_cuda
    pool.write([0, 1, 2], make_kv(40, seed=1, device=GPU))
    for block in range(3):
        on_gpu = pool.block_checksum(block, LAYOUT.block_bytes)
        assert on_gpu == wsum64(pool.block_view(block).cpu()) == checksum(pool.block_view(block), "wsum64")
    flipped = pool.block_view(1).cpu()
    flipped[7] ^= 1
    assert wsum64(flipped) != pool.block_checksum(1, LAYOUT.block_bytes)  # negative control


def _gpu_sender(conn, fault: bool) -> None:
    """A prefill side in its own process: a GPU pool offered by CUDA IPC handle."""
    transport = MooncakeTransport()
    sender = KVSender(
        "prefill-gpu-child",
        LAYOUT,
        BlockPool(LAYOUT, 16, shared=True, device=GPU),
        transport,
        lease_timeout_s=60.0,
    )
    if fault:
        faults.arm("kv.publish.flip", block_index=1, byte_offset=9, after_checksum=True)
    desc = sender.publish("t-ipc", make_kv(37, seed=2, device=GPU))
    conn.send(desc.to_params())
    conn.recv()  # until the decode side is done with the blocks
    sender.release("t-ipc")
    sender.close()


@pytest.mark.parametrize("fault", [False, True], ids=["exact", "flipped-byte"])
def test_cuda_ipc_handoff_between_processes(fault):
    """The decode side opens the prefill process's GPU pool by handle and copies the blocks device
    to device, verified on the device; a byte changed after publish is caught."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_sender, args=(child, fault))
    proc.start()
    receiver = KVReceiver(
        LAYOUT, BlockPool(LAYOUT, 16, device=GPU), MooncakeTransport(), same_host="cuda_ipc"
    )
    try:
        desc = KVDescriptor.from_params(parent.recv())
        assert desc.cuda_ipc and desc.checksum_kind == "wsum64"
        if fault:
            with pytest.raises(KVIntegrityError, match="block 1"):
                receiver.fetch(desc)
        else:
            result = receiver.fetch(desc)
            assert result.path == "cuda_ipc" and result.kv_canonical.is_cuda
            assert torch.equal(result.kv_canonical.cpu(), make_kv(37, seed=2))
        assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    finally:
        parent.send("done")
        proc.join(60)
        receiver.close()
    assert proc.exitcode == 0


@pytest.mark.parametrize("buffer_device", ["cpu", None])
def test_gpu_pools_over_mooncake(buffer_device):
    """Across hosts: Mooncake reads GPU memory where its build can, else both sides stage
    through pinned host copies; either way the KV lands in the GPU pool unchanged."""
    sender = KVSender(
        "prefill-gpu-tcp",
        LAYOUT,
        BlockPool(LAYOUT, 16, device=GPU),
        MooncakeTransport(),
        lease_timeout_s=60.0,
        buffer_device=buffer_device,
        same_host=False,
    )
    receiver = KVReceiver(
        LAYOUT,
        BlockPool(LAYOUT, 16, device=GPU),
        MooncakeTransport(),
        same_host="off",
        buffer_device=buffer_device,
    )
    try:
        if buffer_device == "cpu":
            assert sender.landing.memory().is_pinned() and receiver.landing.memory().is_pinned()
        kv = make_kv(45, seed=3, device=GPU)
        result = receiver.fetch(sender.publish("t-gpu-tcp", kv))
        assert result.path == "tcp" and torch.equal(result.kv_canonical, kv)
        sender.release("t-gpu-tcp")
    finally:
        sender.close()
        receiver.close()


# -- batch invariance on the GPU ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_runner(tiny_model, tiny_tokenizer):
    import copy

    from omni_pd.engines.device import enter
    from omni_pd.models.qwen3_omni.hf.build import thinker_model

    enter(GPU)
    try:
        yield thinker_model(copy.deepcopy(tiny_model).to(GPU), tiny_tokenizer)
    finally:
        torch.set_default_device(None)


def test_a_request_decodes_to_the_same_bits_alone_and_in_a_batch_on_the_gpu(gpu_runner, tiny_tokenizer):
    from test_thinker_engine import TEXTS, _engine, _params, _prompts, _run_together, _same

    prompts, params = _prompts(tiny_tokenizer), _params(len(TEXTS))
    engine = _engine(gpu_runner, attention_kernels="torch")
    assert engine.kv.cache.pool.device.type == "cuda"
    solo = [engine.generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
    together, _ = _run_together(engine, prompts, params)
    assert engine.batch_stats()["max_decode_batch"] == len(prompts)
    for i in range(len(prompts)):
        assert _same(solo[i], together[i]), TEXTS[i]
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
    # Negative control: the comparison sees one changed bit in one request's KV.
    engine.add_request("n0", prompts[0], params[0])
    engine.step()  # prefilled: its blocks hold the prompt's KV
    request = engine.scheduler.requests["n0"]
    engine.kv.cache.pool.block_view(request.blocks[0])[3] ^= 0x01
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    assert not _same(solo[0], outs[0].output)


def test_norms_give_a_row_the_same_bits_at_any_row_count_on_the_gpu(tiny_model):
    """`bi.norm`: a row's RMSNorm bits do not depend on how many rows share the call, on the GPU
    too, at the tiny and the real widths (hidden 2048, head 128). Negative control: the plain
    module at the real hidden width, whose CUDA reduction changes shape with few rows."""
    from omni_pd.engines.hf import batch_invariant as bi

    norm_cls = type(tiny_model.thinker.model.norm)
    gen = torch.Generator().manual_seed(4)
    plain_moves = False
    for width in (tiny_model.thinker.config.text_config.hidden_size, 128, 2048):
        norm = norm_cls(width, eps=1e-6).to(GPU)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=gen, device="cpu"))
            rows = (torch.randn(200, width, generator=gen, device="cpu") * 3).to(GPU)
            whole = norm(rows)
            for count in list(range(1, 80)) + [127, 199]:
                assert torch.equal(bi.norm(norm, rows[:count]), whole[:count]), (width, count)
                plain_moves |= width == 2048 and not torch.equal(norm(rows[:count]), whole[:count])
    assert plain_moves


def test_chunked_and_cached_prefills_equal_the_whole_prompt_on_the_gpu(gpu_runner, tiny_tokenizer):
    """Chunked prefill beside running decodes, and a prefill over cached blocks, give the rows,
    tokens and KV of the whole prompt's prefill on cuda:0 (tests/test_chunked_prefill.py on the
    GPU). What the first GPU run found broken: a prompt over cached blocks computes its last few
    rows alone, and the norms' bits moved with the row count."""
    from test_chunked_prefill import BUDGET, LONG, _params, _prompts, _run, _same, _thinker

    def engine(**args):
        return _thinker(gpu_runner, attention_kernels="torch", **args)

    prompts, params = _prompts(tiny_tokenizer), _params(len(LONG))
    whole, whole_kv, _ = _run(engine(enable_prefix_caching=False), prompts, params)
    chunked_engine = engine(max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    assert chunked_engine.kv.cache.pool.device.type == "cuda"
    chunked, chunked_kv, _ = _run(chunked_engine, prompts, params, stagger=3)
    assert chunked_engine.batch_stats()["partial_chunks"] > 0
    for i in range(len(prompts)):
        assert _same(whole[i], chunked[i]), LONG[i]
        assert torch.equal(whole_kv[i], chunked_kv[i]), LONG[i]
    first, second = _prompts(tiny_tokenizer, [LONG[0], LONG[0] + " and then the storm came"])
    want, want_kv, _ = _run(engine(enable_prefix_caching=False), [second], params[1:2])
    cached = engine()
    _run(cached, [first], params[:1])
    got, got_kv, _ = _run(cached, [second], params[1:2])
    assert got[0].metrics["prefix_cached_tokens"] > 0
    assert _same(want[0], got[0]) and torch.equal(want_kv[0], got_kv[0])


def test_prompt_attention_rows_do_not_depend_on_the_call_on_the_gpu():
    """`attend_rows` on cuda:0: a row's bits the same whole, from any cached start, or as the
    prefix of a longer prompt (tests/test_batch_invariant.py's check, run on the GPU)."""
    from test_batch_invariant import check_attention_rows

    check_attention_rows(GPU)
