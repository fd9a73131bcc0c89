"""Prefill and decode engines that page their KV in different block sizes (one dividing the
other) hand it over exactly: the decode leg's output equals the colocated engine's byte for byte
(tokens, output embeddings and hidden states), in one process with real Mooncake (loopback tcp).
A pull reads the prefill's blocks into staging and converts them into the decode layout. A
negative control flips one byte of the handed-over KV and shows the comparison notices."""

import time

import pytest
import torch

torch.set_num_threads(1)

from omni_pd.config import load_pipeline_config  # noqa: E402
from omni_pd.engines.core.ar_engine import ArEngine  # noqa: E402
from omni_pd.engines.core.pd_legs import DecodeEngine, PrefillEngine  # noqa: E402
from omni_pd.models.qwen3_omni.hf.build import thinker_model  # noqa: E402
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner  # noqa: E402
from omni_pd.models.qwen3_omni.records import ThinkerPrompt  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402
from omni_pd.planning.pd import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402
from omni_pd.sampling import SamplingParams  # noqa: E402

COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
# Prompt lengths around the block sizes: under one small block, across several, aligned to 32.
TEXTS = ["hi", "tell me about the sea, the tides and the moon in a few words", "x" * 52]


def pd_stage(stage_id: int, block_size: int, **extra):
    """Stage `stage_id` of the tiny P/D pipeline with its kv_block_size and extra handoff keys
    (Mooncake tcp: kv_same_host off)."""
    stage = load_pipeline_config(PD).stage(stage_id)
    kv = stage.kv_transfer_config
    merged = {**kv.kv_connector_extra_config.model_dump(exclude_unset=True), "kv_same_host": "off", **extra}
    kv = kv.model_copy(update={"kv_connector_extra_config": type(kv.kv_connector_extra_config)(**merged)})
    args = stage.engine_args.model_copy(update={"kv_transfer_config": kv, "kv_block_size": block_size})
    return stage.model_copy(update={"engine_args": args})


def prompts(tokenizer, texts=TEXTS) -> list[ThinkerPrompt]:
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]


def params(i: int) -> SamplingParams:
    return (
        SamplingParams(temperature=0, max_tokens=10)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=100 + i)
    )


def same_output(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


def run_decode(decode, request_id, prompt, decode_params):
    """Add one request to the decode engine and step it to its end (sleeping the engine's own
    step delay between polls, as its worker does); returns the finished step output."""
    decode.add_request(request_id, prompt, decode_params)
    while True:
        for out in decode.step():
            if out.finished:
                return out
        time.sleep(decode.step_delay_s())


def handoff(prefill, decode, request_id, prompt, sampling):
    transfer_id = f"{request_id}-xfer"
    out = prefill.generate(request_id, prompt, build_prefill_sampling_params(sampling, transfer_id))
    decode_params = build_decode_sampling_params(sampling, out.kv_transfer_params, transfer_id)
    try:
        return run_decode(decode, request_id, prompt, decode_params)
    finally:
        prefill.release_kv(transfer_id)


@pytest.fixture(scope="module")
def runner(tiny_model, tiny_tokenizer):
    return thinker_model(tiny_model, tiny_tokenizer)


@pytest.fixture(scope="module")
def colocated(runner, tiny_tokenizer):
    engine = ArEngine(load_pipeline_config(COLOCATED).stage(0), ThinkerRunner(runner))
    return {i: engine.generate(f"c{i}", p, params(i)) for i, p in enumerate(prompts(tiny_tokenizer))}


def assert_clean(*engines) -> None:
    for engine in engines:
        counts = engine.debug_state_counts()
        assert all(v == 0 for v in counts.values()), counts


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(16, 32), (32, 16)])
def test_pull_between_block_sizes_equals_colocated(
    runner, colocated, tiny_tokenizer, prefill_block, decode_block
):
    prefill = PrefillEngine(pd_stage(0, prefill_block), ThinkerRunner(runner))
    decode = DecodeEngine(pd_stage(1, decode_block), ThinkerRunner(runner))
    try:
        assert prefill.layout.block_size == prefill_block and decode.layout.block_size == decode_block
        for i, prompt in enumerate(prompts(tiny_tokenizer)):
            out = handoff(prefill, decode, f"m{i}", prompt, params(i))
            assert out.error is None, out.error
            assert same_output(out.output, colocated[i]), TEXTS[i]
            assert out.output.metrics["kv_path"] == "tcp"
            # Every prompt position moved (the last block's filled part only, in token_major).
            n = len(prompt.prompt_token_ids)
            assert out.output.metrics["kv_bytes_transferred"] == n * prefill.layout.bytes_per_token
        # Negative control: one byte flipped in the prefill's first block before its checksums
        # travels unnoticed by the handoff, and the output differs from colocated.
        prefill.control("arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
        out = handoff(prefill, decode, "bad", prompts(tiny_tokenizer)[1], params(1))
        assert out.error is None and not same_output(out.output, colocated[1])
        assert_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()
