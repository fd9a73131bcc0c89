"""Push mode of the hf P/D pair, in one process with real Mooncake (loopback tcp): the decode
engine reserves a request's blocks, the prefill engine writes each chunk's blocks into them as it
computes the prompt, and the decode engine verifies them in place and decodes. Pushed output
equals pulled and colocated output byte for byte (tokens, output embeddings and hidden states,
prompt rows), between equal and mixed block sizes, with a negative control; the prefix-cache
delta still moves only the missing blocks; faults end within the request's wait and leave
nothing behind on either side."""

import pytest
import torch

torch.set_num_threads(1)

from omni_pd.engines.core.pd_legs import DecodeEngine, PrefillEngine  # noqa: E402
from omni_pd.kv.push import RECORD_KEY, TARGET_KEY  # noqa: E402
from omni_pd.models.qwen3_omni.hf.thinker_stage import ThinkerStageRunner  # noqa: E402
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
    prefill = PrefillEngine(
        pd_stage(0, prefill_block, kv_push_chunk_tokens=CHUNK), ThinkerStageRunner(runner)
    )
    decode = DecodeEngine(
        pd_stage(1, decode_block, transfer_mode="push", **decode_extra), ThinkerStageRunner(runner)
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
        prefill.inject_kv_fault(block_index=0, byte_offset=3)
        out = pushed(prefill, decode, "bad", prompts(tiny_tokenizer)[1], params(1))
        assert out.error is None and not same_output(out.output, colocated[1])
        assert_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()
