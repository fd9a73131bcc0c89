"""Greedy P/D (thinker prefill and decode in separate processes, KV over Mooncake) equals the
colocated pipeline byte for byte: thinker tokens, merged talker inputs, codec codes, audio. And
batching changes nothing: requests run all at once equal the same requests run alone, in both
pipelines."""

import asyncio
import os

import numpy as np
import pytest
import torch

from omni_pd.engines.base import StageInputs
from omni_pd.models.qwen3_omni.stage_input_processors import thinker2talker
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.exactness]
# scripts/gpu_check.sh runs this file with OMNI_PD_E2E_DEVICE=cuda: the same prompts with every
# hf stage on cuda:0 (colocated and P/D on the GPU are compared with each other).
_CUDA = "_cuda" if os.environ.get("OMNI_PD_E2E_DEVICE", "cpu") == "cuda" else ""
# scripts/test.sh runs it again with OMNI_PD_E2E_DTYPE=bfloat16 where the host has bf16 kernels:
# every hf stage in bfloat16 (weights, activations and KV; torch's kernels), the same claims.
DTYPE = os.environ.get("OMNI_PD_E2E_DTYPE", "float32")
BLOCK = 16


def _config(path, tmp_path_factory):
    """`path` as it is, or a copy with every stage in DTYPE."""
    if DTYPE == "float32":
        return path
    text = path.read_text()
    assert "dtype: float32" in text
    copy = tmp_path_factory.mktemp(DTYPE) / path.name
    copy.write_text(text.replace("dtype: float32", f"dtype: {DTYPE}"))
    return copy


_COLOCATED = STAGE_CONFIGS_DIR / "ci" / f"qwen3_omni_tiny{_CUDA}.yaml"
_PD = STAGE_CONFIGS_DIR / "ci" / f"qwen3_omni_tiny{_CUDA}_pd.yaml"


@pytest.fixture(scope="module")
def colocated_config(tmp_path_factory):
    return _config(_COLOCATED, tmp_path_factory)


@pytest.fixture(scope="module")
def pd_config(tmp_path_factory):
    return _config(_PD, tmp_path_factory)


@pytest.fixture(scope="module")
def colocated(colocated_config):
    with Omni(stage_configs_path=colocated_config, keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd(pd_config):
    with Omni(stage_configs_path=pd_config, keep_stage_outputs=True) as omni:
        yield omni


def _whole_config(tmp_path_factory, path):
    """The same pipeline with streaming between stages off (async_chunk: false)."""
    text = path.read_text()
    assert "\nasync_chunk: true\n" in text
    whole = tmp_path_factory.mktemp("whole") / path.name
    whole.write_text(text.replace("\nasync_chunk: true\n", "\nasync_chunk: false\n"))
    return whole


@pytest.fixture(scope="module")
def colocated_whole(tmp_path_factory, colocated_config):
    with Omni(
        stage_configs_path=_whole_config(tmp_path_factory, colocated_config), keep_stage_outputs=True
    ) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd_whole(tmp_path_factory, pd_config):
    with Omni(stage_configs_path=_whole_config(tmp_path_factory, pd_config), keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    for name in ("colocated", "pd", "colocated_whole", "pd_whole"):
        if name in request.fixturenames:
            counts = request.getfixturevalue(name).debug_state_counts()
            assert all(v == 0 for v in counts.values()), counts


def _block_aligned_prompt(omni, tokens=2 * BLOCK):
    tokenizer = omni.tokenizer

    def ids(text):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    overhead = len(ids(""))
    prompt = ids("x" * (tokens - overhead))  # byte-level tokenizer: one ASCII char, one token
    assert len(prompt) == tokens
    return {"prompt_token_ids": prompt}


def _prompts(omni):
    tone = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
    return {
        "short": "Hi",
        "over_one_block": "Please describe, in a few sentences, how tides are made by the moon.",
        "block_aligned": _block_aligned_prompt(omni),
        "multi_turn": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And another one?"},
        ],
        "long_1000": "The quick brown fox jumps over the lazy dog. " * 24,
        "audio": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this sound?"},
                    {"type": "audio", "audio": tone},
                ],
            }
        ],
    }


def _talker_input(omni, out):
    talker_stage = next(s.stage_id for s in omni.config.stages if s.model_stage == "talker")
    stage = omni.stages[talker_stage]
    return thinker2talker(
        StageInputs(
            out.request_id,
            talker_stage,
            tuple(stage.engine_input_source),
            out.stage_outputs,
            omni.model_config,
        )
    )


def _codes(omni, out):
    talker_stage = next(s.stage_id for s in omni.config.stages if s.model_stage == "talker")
    return out.stage_outputs[talker_stage].codes


def differences(omni_a, a, omni_b, b) -> list[str]:
    """Every way two outputs of the same request differ; empty when byte-identical."""
    found = []
    if a.token_ids != b.token_ids:
        found.append("thinker token ids")
    ta, tb = _talker_input(omni_a, a), _talker_input(omni_b, b)
    if not torch.equal(ta.thinker_embeds, tb.thinker_embeds):
        found.append("talker input embeddings")
    if not torch.equal(ta.thinker_hidden, tb.thinker_hidden):
        found.append("talker input hidden states")
    if not torch.equal(_codes(omni_a, a), _codes(omni_b, b)):
        found.append("codec codes")
    if a.audio_sha256 != b.audio_sha256:
        found.append("audio bytes")
    return found


def _per_token_kv_bytes(omni, dtype: str = DTYPE):
    """K and V of every layer for one token, in `dtype` (the suite's, by default)."""
    text = omni.model_config.thinker_config.text_config
    width = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    # Qwen2.5-Omni's text config names no head_dim: it is hidden / heads there.
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * width


CASES = ["short", "over_one_block", "block_aligned", "multi_turn", "long_1000", "audio"]
_alone: dict[tuple[str, str], object] = {}


def alone(omni, which: str, case: str):
    """The case run by itself (cached: the batching tests compare against the same runs)."""
    if (which, case) not in _alone:
        _alone[which, case] = omni.generate([_prompts(omni)[case]])[0]
    return _alone[which, case]


@pytest.mark.parametrize("case", CASES)
def test_pd_equals_colocated(colocated, pd, case):
    want = alone(colocated, "colocated", case)
    got = alone(pd, "pd", case)
    assert got.prompt_token_ids == want.prompt_token_ids
    if case == "long_1000":
        assert len(got.prompt_token_ids) >= 1000
    if case == "block_aligned":
        assert len(got.prompt_token_ids) % BLOCK == 0
    if case == "audio":
        assert got.prompt_token_ids.count(pd.model_config.thinker_config.audio_token_id) > 1
    assert got.audio is not None and got.audio.numel() > 0
    assert differences(colocated, want, pd, got) == []
    # Every prompt position came over the wire, and exactly those bytes.
    assert got.metrics["num_cached_prompt_tokens"] == len(got.prompt_token_ids)
    assert got.metrics["kv_bytes_transferred"] == len(got.prompt_token_ids) * _per_token_kv_bytes(pd)
    assert got.metrics["kv_transfer_ms"] > 0


@pytest.fixture(scope="module")
def pd_chunked(tmp_path_factory, pd_config):
    """P/D with the prefill leg's step budget at 64 tokens: every prompt over it is prefilled in
    chunks over several steps (chunked prefill, the engine's default)."""
    text = pd_config.read_text()
    first = "\n      kv_block_size: 16\n"
    assert first in text
    copy = tmp_path_factory.mktemp("chunked") / pd_config.name
    copy.write_text(text.replace(first, first + "      max_num_batched_tokens: 64\n", 1))
    with Omni(stage_configs_path=copy, keep_stage_outputs=True) as omni:
        assert omni.config.stage(0).max_num_batched_tokens == 64
        yield omni


def test_a_chunked_prefill_leg_equals_colocated_whole(colocated, pd_chunked):
    """Chunked = whole through the omni pipeline: thinker tokens, talker inputs, codes, audio
    (`differences` is seen to fail by the flipped-byte control below)."""
    cases = ["over_one_block", "long_1000", "audio"]
    got = pd_chunked.generate([_prompts(pd_chunked)[case] for case in cases])
    for case, out in zip(cases, got):
        assert differences(colocated, alone(colocated, "colocated", case), pd_chunked, out) == [], case
    stats = pd_chunked.control(0, "batch_stats")
    assert stats["partial_chunks"] >= 1000 // 64 and stats["max_step_tokens"] <= 64
    assert all(v == 0 for v in pd_chunked.debug_state_counts().values())


def test_negative_control_one_flipped_byte_is_noticed(colocated, pd):
    prompt = _prompts(colocated)["over_one_block"]
    want = colocated.generate([prompt])[0]
    # Flip the exponent byte of the first K value of layer 0 in the first block the prefill
    # engine publishes (before its checksums, so the corruption travels undetected).
    pd.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
    corrupted = pd.generate([prompt])[0]
    found = differences(colocated, want, pd, corrupted)
    assert "talker input hidden states" in found, found
    # And the very next request is clean again.
    assert differences(colocated, want, pd, pd.generate([prompt])[0]) == []


def test_sampled_requests_match_too(colocated, pd):
    from omni_pd.sampling import SamplingParams

    thinker = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1234)
    want = colocated.generate(["Tell me a story."], [thinker, None, None])[0]
    got = pd.generate(["Tell me a story."], [thinker, None, None])[0]  # N-1 params, expanded
    assert differences(colocated, want, pd, got) == []


def _thinker_decoding_stage(omni) -> int:
    pair = omni.pd_pair
    return pair.decode_stage_id if pair else 0


@pytest.mark.parametrize("which", ["colocated", "pd"])
def test_six_prompts_all_at_once_equal_each_alone(colocated, pd, which):
    omni = {"colocated": colocated, "pd": pd}[which]
    want = [alone(omni, which, case) for case in CASES]
    before = omni.control(_thinker_decoding_stage(omni), "batch_stats")["max_decode_batch"]
    got = omni.generate([_prompts(omni)[case] for case in CASES])
    for case, a, b in zip(CASES, want, got):
        assert differences(omni, a, omni, b) == [], case
    # They really shared decode steps (the thinker's, and the talker's).
    assert omni.control(_thinker_decoding_stage(omni), "batch_stats")["max_decode_batch"] > max(before, 1)
    talker = next(s.stage_id for s in omni.config.stages if s.model_stage == "talker")
    assert omni.control(talker, "batch_stats")["max_decode_batch"] > 1


def test_negative_control_batching_without_invariant_kernels_is_noticed(pd):
    """With the tiled linear layers switched off in the decode and talker workers, the same
    all-at-once run no longer equals the solo runs: the comparison above can fail."""
    if DTYPE != "float32":
        # In bfloat16, torch's CPU gemm accumulates in float32 and rounds each output once, and the
        # rounding hides almost every change of order: at the tiny model's widths about one row in
        # a thousand of a plain 2-7 row `F.linear` differs from the same row alone. Whether a run
        # of six requests meets such a row depends on which rows share a step (in eight runs of
        # eight on a quiet host, in none of three in a loaded CI run): no control that must fail.
        # The float32 pass shows this comparison notices batch variance; this pass's flipped-byte
        # control shows `differences` notices a one-byte change in bfloat16.
        pytest.skip(
            "batch variance of plain bf16 kernels is too rare to show on demand (float32 pass has it)"
        )
    talker = next(s.stage_id for s in pd.config.stages if s.model_stage == "talker")
    want = [alone(pd, "pd", case) for case in CASES]
    for stage in (pd.pd_pair.decode_stage_id, talker):
        pd.control(stage, "set_batch_invariant", enabled=False)
    # Which rows share a step depends on timing: up to three all-at-once runs, any of which may
    # show it (in float32 a plain batched `F.linear` changes the last bits of most rows).
    noticed = False
    try:
        for _ in range(3):
            got = pd.generate([_prompts(pd)[case] for case in CASES])
            noticed = any(differences(pd, a, pd, b) for a, b in zip(want, got))
            if noticed:
                break
    finally:
        for stage in (pd.pd_pair.decode_stage_id, talker):
            pd.control(stage, "set_batch_invariant", enabled=True)
    assert noticed


@pytest.mark.parametrize("which", ["colocated", "pd", "colocated_whole", "pd_whole"])
def test_an_answer_that_stops_at_once_is_text_without_speech_not_an_error(request, which):
    """A thinker whose first token stops it (EOS first) leaves nothing to speak: the request
    answers with that text and no audio, streamed or not, and the audio stages never see it."""
    from omni_pd.orchestrator.async_omni import AudioDelta, Finished
    from omni_pd.sampling import SamplingParams

    omni = request.getfixturevalue(which)
    prompt = _prompts(omni)["over_one_block"]
    spoken = alone(omni, which, "over_one_block")
    assert spoken.audio is not None and "no_speech" not in spoken.metrics  # negative control
    first = spoken.token_ids[0]
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(first,))
    out = omni.generate([prompt], [stop, None, None])[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    assert out.audio is None and out.metrics["no_speech"] is True
    talker = _stage_of(omni, "talker")
    assert str(talker) not in out.metrics["stage_ms"]  # the talker never ran
    events = list(omni.stream(prompt, [stop, None, None]))
    assert not any(isinstance(e, AudioDelta) for e in events)
    assert isinstance(events[-1], Finished) and events[-1].output.token_ids == [first]


MIXED_TEXTS = [
    "Hi",
    "Tell me a story.",
    "What is the capital of France?",
    "Count to five.",
    "Describe the sea at night.",
    "Why is the sky blue?",
    "Sing me a song.",
    "Bonjour!",
]


def _mixed_requests(omni):
    """16 requests: greedy and seeded-sampled thinkers, talkers with different seeds, several
    lengths, an audio prompt among them."""
    from omni_pd.sampling import SamplingParams

    requests = []
    for i in range(16):
        prompt = MIXED_TEXTS[i % len(MIXED_TEXTS)] if i != 5 else _prompts(omni)["audio"]
        thinker = (
            SamplingParams(temperature=0, max_tokens=8 + i % 5)
            if i % 2 == 0
            else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1000 + i)
        )
        talker = SamplingParams(temperature=0.9, top_k=50, max_tokens=24 + i, seed=i, repetition_penalty=1.05)
        requests.append((prompt, [thinker, talker, None]))
    return requests


def _at_once(omni, requests):
    """Every request submitted at once (concurrency = len(requests)), each with its own params."""
    futures = [
        asyncio.run_coroutine_threadsafe(omni.engine.generate(prompt, params), omni._loop)
        for prompt, params in requests
    ]
    return [f.result(300) for f in futures]


@pytest.mark.parametrize("which", ["colocated", "pd"])
def test_sixteen_mixed_requests_at_concurrency_16_equal_their_solo_runs(colocated, pd, which):
    omni = {"colocated": colocated, "pd": pd}[which]
    requests = _mixed_requests(omni)
    solo = [omni.generate([prompt], params)[0] for prompt, params in requests]
    together = _at_once(omni, requests)
    for i, (a, b) in enumerate(zip(solo, together)):
        assert differences(omni, a, omni, b) == [], i
    assert len({tuple(o.token_ids) for o in solo}) > 4  # they are not all the same request


# -- streaming between stages (async_chunk) ---------------------------------------------------------


def _stage_of(omni, model_stage: str) -> int:
    return next(s.stage_id for s in omni.config.stages if s.model_stage == model_stage)


def _long_speech(omni):
    """Sampling params (one per logical stage) under which the talker runs to its max_tokens:
    random weights sample a codec EOS at an arbitrary step, often within the first chunk."""
    talker = omni.engine.stages[_stage_of(omni, "talker")].default_sampling_params
    return [None, talker.replace(ignore_eos=True), None]


@pytest.mark.parametrize("which", ["colocated", "pd"])
def test_streamed_stages_equal_whole_stages(request, which):
    """The shipped configs stream thinker -> talker -> code2wav; the same requests with streaming
    off give the same tokens, talker inputs, codec codes and audio bytes."""
    streamed_omni = request.getfixturevalue(which)
    whole_omni = request.getfixturevalue(f"{which}_whole")
    assert streamed_omni.config.async_chunk and not whole_omni.config.async_chunk
    prompts = [_prompts(streamed_omni)[case] for case in CASES]
    streamed, whole = streamed_omni.generate(prompts), whole_omni.generate(prompts)
    # Plus one answer whose speech surely spans several chunks.
    long_params = _long_speech(streamed_omni)
    streamed += streamed_omni.generate([prompts[1]], long_params)
    whole += whole_omni.generate([prompts[1]], long_params)
    talker, code2wav = _stage_of(streamed_omni, "talker"), _stage_of(streamed_omni, "code2wav")
    thinker = _thinker_decoding_stage(streamed_omni)
    first_chunk = streamed_omni.config.stage(code2wav).engine_args.initial_codec_chunk_frames
    for case, a, b in zip(CASES + ["long speech"], whole, streamed):
        assert differences(whole_omni, a, streamed_omni, b) == [], case
        stages = b.metrics["timeline"]["stages"]
        # Really streamed: the talker started on the thinker's second token (in P/D, the decode
        # leg's), code2wav ran while the talker did, and audio longer than the first chunk left
        # in chunks.
        if len(b.token_ids) > 2:
            assert stages[str(talker)]["start_ms"] < stages[str(thinker)]["end_ms"], case
        assert stages[str(code2wav)]["start_ms"] < stages[str(talker)]["end_ms"]
        if _codes(streamed_omni, b).shape[1] > first_chunk:
            assert len(b.metrics["timeline"]["audio_chunks_ms"]) > 1, case
        assert b.metrics["ttfa_ms"] < b.metrics["e2e_ms"]
        assert a.metrics["timeline"]["audio_chunks_ms"] == []  # whole: one piece at the end
    assert _codes(streamed_omni, streamed[-1]).shape[1] > 2 * first_chunk


def test_negative_control_too_little_codec_context_is_noticed(colocated, colocated_whole):
    """With code2wav re-decoding a left context below its receptive field instead of carrying its
    state, streamed audio stops equalling the whole-utterance audio (while the codes still
    match): the comparison above can fail."""
    prompt, params = _prompts(colocated)["over_one_block"], _long_speech(colocated)
    want = colocated_whole.generate([prompt], params)[0]
    code2wav = _stage_of(colocated, "code2wav")
    previous = colocated.control(code2wav, "set_left_context_frames", frames=2)
    try:
        got = colocated.generate([prompt], params)[0]
    finally:
        colocated.control(code2wav, "set_left_context_frames", frames=previous)
    assert previous is None  # the shipped default: carried state
    assert differences(colocated_whole, want, colocated, got) == ["audio bytes"]
