"""Push mode of the hf P/D pair, in one process with real Mooncake (loopback tcp): the decode
engine reserves a request's blocks, the prefill engine writes each chunk's blocks into them as it
computes the prompt, and the decode engine verifies them in place and decodes. Pushed output
equals pulled and colocated output byte for byte (tokens, output embeddings and hidden states,
prompt rows), between equal and mixed block sizes, with a negative control; the prefix-cache
delta still moves only the missing blocks; faults end within the request's wait and leave
nothing behind on either side."""

import time
from types import SimpleNamespace

import pytest
import torch

torch.set_num_threads(1)

from omni_pd.engines.core.pd_legs import DecodeEngine, PrefillEngine  # noqa: E402
from omni_pd.engines.core.push_legs import chunk_tokens  # noqa: E402
from omni_pd.kv.errors import KVIncompatibleError, KVMissError  # noqa: E402
from omni_pd.kv.push import RECORD_KEY, TARGET_KEY, PushReservations, PushTarget  # noqa: E402
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner  # noqa: E402
from omni_pd.planning.pd import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402

from test_kv_block_sizes import (  # noqa: E402
    TEXTS,
    assert_clean,
    colocated,  # noqa: F401 - a fixture
    params,
    pd_stage,
    prompts,
    run_decode,
    runner,  # noqa: F401 - a fixture
    same_output,
)

CHUNK = 32  # kv_push_chunk_tokens here: several chunks per prompt, so writes overlap compute


def push_pair(runner, prefill_block, decode_block, **decode_extra):
    prefill = PrefillEngine(pd_stage(0, prefill_block, kv_push_chunk_tokens=CHUNK), ThinkerRunner(runner))
    decode = DecodeEngine(
        pd_stage(1, decode_block, transfer_mode="push", **decode_extra), ThinkerRunner(runner)
    )
    return prefill, decode


def pushed(prefill, decode, request_id, prompt, sampling, wait_s=5.0):
    """The orchestrator's push handoff: reserve on the decode engine, prefill with the target,
    hand the completion record on. Returns the decode engine's finished step output."""
    transfer_id = f"{request_id}-xfer"
    target = decode.reserve_kv(transfer_id, prompt, sampling, wait_s)
    prefill_params = build_prefill_sampling_params(sampling, transfer_id)
    prefill_params = prefill_params.replace(
        kv_transfer_params={**prefill_params.kv_transfer_params, TARGET_KEY: target}
    )
    out = prefill.generate(request_id, prompt, prefill_params)
    assert RECORD_KEY in out.kv_transfer_params
    return run_decode(
        decode,
        request_id,
        prompt,
        build_decode_sampling_params(sampling, out.kv_transfer_params, transfer_id),
    )


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(16, 16), (16, 32), (32, 16)])
def test_push_equals_colocated(runner, colocated, tiny_tokenizer, prefill_block, decode_block):
    prefill, decode = push_pair(runner, prefill_block, decode_block)
    try:
        for i, prompt in enumerate(prompts(tiny_tokenizer)):
            out = pushed(prefill, decode, f"p{i}", prompt, params(i))
            assert out.error is None, out.error
            assert same_output(out.output, colocated[i]), TEXTS[i]
            n = len(prompt.prompt_token_ids)
            assert out.output.metrics["kv_path"] == "push"
            assert out.output.metrics["kv_bytes_transferred"] == n * prefill.layout.bytes_per_token
        # Negative control: one byte flipped in the first pushed block before its checksum
        # travels unnoticed, and the output differs from colocated.
        prefill.control("arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
        out = pushed(prefill, decode, "bad", prompts(tiny_tokenizer)[1], params(1))
        assert out.error is None and not same_output(out.output, colocated[1])
        assert_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def _wait_until(condition, engine, limit_s: float = 10.0) -> None:
    """Run the engine's housekeeping until `condition()` holds (polling under a deadline)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        engine.housekeeping()
        time.sleep(0.01)


@pytest.fixture(scope="module")
def pair(runner):
    # kv_lease_timeout_s on the decode stage: how long an abandoned reservation stays fenced.
    prefill, decode = push_pair(runner, 16, 32)
    stage = pd_stage(1, 32, transfer_mode="push")
    args = stage.engine_args.model_copy(update={"kv_lease_timeout_s": 0.3})
    decode.close()
    decode = DecodeEngine(stage.model_copy(update={"engine_args": args}), ThinkerRunner(runner))
    yield prefill, decode
    prefill.close()
    decode.close()


def test_reserved_blocks_count_against_admission_and_are_freed_when_released(pair, tiny_tokenizer):
    _, decode = pair
    prompt, sampling = prompts(tiny_tokenizer)[2], params(0)
    free = decode.load()["free_kv_blocks"]
    decode.reserve_kv("r-x", prompt, sampling, 5.0)
    need = decode.kv.blocks_for(len(prompt.prompt_token_ids))  # the output's come as it decodes
    assert decode.load()["free_kv_blocks"] == free - need
    assert decode.debug_state_counts()["push_reservations"] == 1
    assert decode.release_push("r-x", writer_gone=True)  # the prefill worker died: freed at once
    assert decode.load()["free_kv_blocks"] == free
    assert_clean(decode)


def test_a_reservation_never_written_is_given_up_within_its_wait_and_fenced(pair, tiny_tokenizer):
    _, decode = pair
    free = decode.load()["free_kv_blocks"]
    began = time.monotonic()
    decode.reserve_kv("r-never", prompts(tiny_tokenizer)[1], params(1), 0.2)  # a prefill that died
    _wait_until(lambda: decode.debug_state_counts()["push_reservations"] == 0, decode)
    assert 0.2 <= time.monotonic() - began < 1.0
    # A writer that may still be alive (frozen) could write late: the blocks stay out of use.
    assert decode.debug_state_counts()["push_fenced_blocks"] > 0
    _wait_until(lambda: decode.debug_state_counts()["push_fenced_blocks"] == 0, decode)
    assert decode.load()["free_kv_blocks"] == free
    assert_clean(decode)


def test_a_record_after_the_decode_side_gave_up_is_discarded_and_counted(pair, tiny_tokenizer):
    prefill, decode = pair
    prompt, sampling = prompts(tiny_tokenizer)[1], params(1)
    target = decode.reserve_kv("late-xfer", prompt, sampling, 0.0)  # its wait runs out at once
    decode.housekeeping()
    assert decode.debug_state_counts()["push_reservations"] == 0
    # The prefill side (its clock behind) still writes, into blocks fenced off from every request.
    prefill_params = build_prefill_sampling_params(sampling, "late-xfer")
    prefill_params = prefill_params.replace(
        kv_transfer_params={**prefill_params.kv_transfer_params, TARGET_KEY: {**target, "wait_s": 5.0}}
    )
    out = prefill.generate("late", prompt, prefill_params)
    late = decode.load()["kv_push_late_records"]
    with pytest.raises(KVMissError, match="after this decode engine gave up"):
        decode.add_request(
            "late", prompt, build_decode_sampling_params(sampling, out.kv_transfer_params, "late-xfer")
        )
    assert decode.load()["kv_push_late_records"] == late + 1
    _wait_until(lambda: decode.debug_state_counts()["push_fenced_blocks"] == 0, decode)
    assert_clean(prefill, decode)


def test_a_dead_decode_peer_fails_the_push_and_the_prefill_keeps_nothing(pair, tiny_tokenizer):
    prefill, decode = pair
    prompt, sampling = prompts(tiny_tokenizer)[2], params(0)
    target = decode.reserve_kv("dead-xfer", prompt, sampling, 5.0)
    assert decode.release_push("dead-xfer", writer_gone=True)
    # The decode worker is gone: nothing listens at its session any more.
    prefill_params = build_prefill_sampling_params(sampling, "dead-xfer")
    prefill_params = prefill_params.replace(
        kv_transfer_params={
            **prefill_params.kv_transfer_params,
            TARGET_KEY: {**target, "session": "127.0.0.1:9"},
        }
    )
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="KVTransferError: transfer dead-xfer: writing the KV"):
        prefill.generate("dead", prompt, prefill_params)
    assert time.monotonic() - began < 5.0
    _wait_until(lambda: prefill.debug_state_counts()["push_fenced_blocks"] == 0, prefill)
    assert_clean(prefill, decode)


def test_a_target_the_prefill_cannot_write_into_is_refused_by_name(pair, tiny_tokenizer):
    prefill, decode = pair
    prompt, sampling = prompts(tiny_tokenizer)[0], params(0)
    target = decode.reserve_kv("odd-xfer", prompt, sampling, 5.0)
    decode.release_push("odd-xfer", writer_gone=True)
    layout = {**target["kv_layout"], "order": "head_major"}
    prefill_params = build_prefill_sampling_params(sampling, "odd-xfer")
    prefill_params = prefill_params.replace(
        kv_transfer_params={**prefill_params.kv_transfer_params, TARGET_KEY: {**target, "kv_layout": layout}}
    )
    with pytest.raises(KVIncompatibleError, match="fused token_major.*transfer_mode: pull"):
        prefill.add_request("odd", prompt, prefill_params)
    assert_clean(prefill, decode)


def test_chunks_end_on_both_block_sizes(pair):
    prefill, decode = pair
    target = PushTarget("t", "s", 1, (), decode.layout, 0, 0, 1.0)
    assert chunk_tokens(prefill, target) == 32


def test_prefix_blocks_shared_by_reservations_count_once(pair):
    """Two reservations of one prompt share its prefix-cache blocks (one pool block, referenced
    twice): held and fenced counts name distinct blocks, so kv_blocks_in_use never goes negative."""
    _, decode = pair
    pool = SimpleNamespace(layout=decode.layout, checksum_kind="xxh3")
    freed: list[int] = []
    pushes = PushReservations("s", pool, SimpleNamespace(base_address=0), freed.extend, fence_s=60.0)
    size = decode.layout.block_size
    pushes.reserve("a", [7, 1, 2], 1, 3 * size, 5.0)
    pushes.reserve("b", [7, 3, 4], 1, 3 * size, 5.0)
    assert pushes.blocks_held == 5  # 6 if block 7 counted twice
    pushes.abandon("a", "test")
    pushes.abandon("b", "test")
    assert pushes.debug_state_counts() == {"push_reservations": 0, "push_fenced_blocks": 5}
    assert pushes.abandon("a", "test", writer_gone=True) and pushes.abandon("b", "test", writer_gone=True)
    assert sorted(freed) == [1, 2, 3, 4, 7, 7] and pushes.blocks_held == 0  # each reference freed


def test_push_under_a_step_budget_smaller_than_its_prompts_equals_colocated(
    runner, colocated, tiny_tokenizer
):
    """Chunked prefill and push together: a pushed prompt longer than the prefill leg's budget
    takes a step of its own and prefills in its push chunks; the decode leg's budget is small
    too. Outputs equal colocated (the push test above has the negative control)."""

    def small(stage):
        return stage.model_copy(
            update={"engine_args": stage.engine_args.model_copy(update={"max_num_batched_tokens": 16})}
        )

    prefill = PrefillEngine(small(pd_stage(0, 16, kv_push_chunk_tokens=CHUNK)), ThinkerRunner(runner))
    decode = DecodeEngine(small(pd_stage(1, 16, transfer_mode="push")), ThinkerRunner(runner))
    try:
        assert max(len(p.prompt_token_ids) for p in prompts(tiny_tokenizer)) > 16
        for i, prompt in enumerate(prompts(tiny_tokenizer)):
            out = pushed(prefill, decode, f"s{i}", prompt, params(i))
            assert out.error is None and same_output(out.output, colocated[i]), TEXTS[i]
        assert prefill.batch_stats()["max_step_tokens"] > 16  # each prompt whole, in its push chunks
        assert_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()
