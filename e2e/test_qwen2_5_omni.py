"""A second omni model through the same core (issue 49): Qwen2.5-Omni on omni-pd's hf engines,
thinker alone and the whole pipeline (thinker -> talker -> token2wav, speech streamed), colocated
and P/D, served by `Omni` with the model named. What the package adds is its runners, records and
processors (omni_pd/models/qwen2_5_omni/); the engines, scheduler, KV plane, P/D legs and the
orchestrator's streaming are the ones Qwen3-Omni runs on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

from test_pd_equivalence import _per_token_kv_bytes
from test_prefix_caching import SYSTEM, _turns

# The whole pipeline's P/D = colocated runs again under the older ISA (marked `exactness`); the
# thinker-alone forms, which it covers, run once.
pytestmark = pytest.mark.slow
COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_thinker.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_thinker_pd.yaml"
SPEECH = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny.yaml"
SPEECH_PD = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_pd.yaml"
PROMPTS = [
    "Hi",
    "Tell me about the sea.",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Count to five.",
]
TONE = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
AUDIO = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is this sound?"}, {"type": "audio", "audio": TONE}],
    }
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7),
]


@pytest.fixture(scope="module")
def colocated():
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=COLOCATED) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd():
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=PD) as omni:
        yield omni


def _clean(omni) -> bool:
    return all(v == 0 for v in omni.debug_state_counts().values())


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_pd_equals_colocated_alone_and_all_at_once(colocated, pd, params):
    want = [colocated.generate([p], [params])[0] for p in PROMPTS]
    assert len({tuple(o.token_ids) for o in want}) == len(PROMPTS)  # the prompts really differ
    alone = [pd.generate([p], [params])[0] for p in PROMPTS]
    together = pd.generate(PROMPTS, [params])
    for w, a, t in zip(want, alone, together):
        assert a.token_ids == w.token_ids and t.token_ids == w.token_ids and a.text == w.text
        # The decode engine computed no prompt position: its KV came from the prefill engine.
        assert a.metrics["num_cached_prompt_tokens"] == len(a.prompt_token_ids)
        assert a.metrics["kv_bytes_transferred"] + a.metrics.get("kv_bytes_reused", 0) > 0
    assert _clean(colocated) and _clean(pd)


def test_negative_control_a_flipped_kv_byte_changes_the_answer(colocated, pd):
    prompt, params = "A prompt no other test sends.", PARAMS[0]
    want = colocated.generate([prompt], [params])[0]
    pd.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
    assert pd.generate([prompt], [params])[0].token_ids != want.token_ids
    assert (
        pd.generate([prompt + " Again."], [params])[0].token_ids
        == colocated.generate([prompt + " Again."], [params])[0].token_ids
    )


def test_a_written_checkpoint_serves_the_same_answers(colocated, tmp_path):
    """`make-tiny-model --model qwen2_5_omni` writes what the seeded build computes: served from
    the directory (dummy weights off: the stage reads the safetensors), the answers are the
    embedded model's."""
    import yaml

    from omni_pd.entrypoints.cli import main

    directory = tmp_path / "ckpt"
    assert main(["make-tiny-model", str(directory), "--model", "qwen2_5_omni", "--seed", "42"]) == 0
    data = yaml.safe_load(COLOCATED.read_text())
    data["stage_args"][0]["engine_args"]["load_format"] = "auto"
    config = tmp_path / "from_checkpoint.yaml"
    config.write_text(yaml.safe_dump(data))
    with Omni(model=str(directory), stage_configs_path=config) as served:
        for prompt in PROMPTS[:2]:
            got = served.generate([prompt], [PARAMS[0]])[0]
            assert got.token_ids == colocated.generate([prompt], [PARAMS[0]])[0].token_ids


@pytest.fixture(scope="module")
def speech():
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=SPEECH, keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(scope="module")
def speech_pd():
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=SPEECH_PD, keep_stage_outputs=True) as omni:
        yield omni


def _stage(omni, model_stage: str) -> int:
    return next(s.stage_id for s in omni.config.stages if s.model_stage == model_stage)


def differences(omni_a, a, omni_b, b) -> list[str]:
    """Every way two outputs of the same request differ: thinker tokens, the talker's merged
    input rows, codec codes, audio; empty when byte-identical (both kept their stage outputs)."""
    from omni_pd.engines.base import StageInputs
    from omni_pd.models.qwen2_5_omni.stage_input_processors import thinker2talker

    def talker_input(omni, out):
        stage = _stage(omni, "talker")
        sources = tuple(omni.stages[stage].engine_input_source)
        return thinker2talker(
            StageInputs(out.request_id, stage, sources, out.stage_outputs, omni.model_config)
        )

    found = []
    if a.token_ids != b.token_ids:
        found.append("thinker token ids")
    if not torch.equal(talker_input(omni_a, a).rows, talker_input(omni_b, b).rows):
        found.append("talker input rows")
    if not torch.equal(
        a.stage_outputs[_stage(omni_a, "talker")].codes, b.stage_outputs[_stage(omni_b, "talker")].codes
    ):
        found.append("codec codes")
    if a.audio_sha256 != b.audio_sha256:
        found.append("audio bytes")
    return found


@pytest.mark.exactness
def test_speech_pd_equals_colocated_text_and_audio_alone_and_all_at_once(speech, speech_pd):
    prompts = PROMPTS + [AUDIO]
    want = [speech.generate([p])[0] for p in prompts]
    assert len({o.audio.numel() for o in want} | {o.text for o in want}) > 2  # the answers differ
    for o in want:
        assert o.audio.numel() > 0 and o.audio.numel() % 480 == 0  # 480 samples a code
        assert 0.05 < float(o.audio.abs().max()) <= 1.0  # audible, in range
    alone = [speech_pd.generate([p])[0] for p in prompts]
    together = speech_pd.generate(prompts)
    for w, a, t in zip(want, alone, together):
        assert differences(speech, w, speech_pd, a) == [] and differences(speech, w, speech_pd, t) == []
        assert a.text == w.text and torch.equal(a.audio, w.audio)
    assert _clean(speech) and _clean(speech_pd)


@pytest.mark.exactness
def test_negative_control_a_flipped_kv_byte_changes_the_speech(speech, speech_pd):
    prompt = "Another prompt no other test sends."
    want = speech.generate([prompt])[0]
    speech_pd.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
    got = speech_pd.generate([prompt])[0]
    assert "talker input rows" in differences(speech, want, speech_pd, got)
    assert _clean(speech_pd)


def test_a_talker_started_while_its_thinker_runs_speaks_the_whole_outputs_codes(speech, tmp_path):
    """With `async_chunk` the talker opens at the thinker's second token and reads each reply row
    as it comes (`thinker2talker_stream`); without it, it starts from the whole output. The same
    thinker tokens, talker input rows and codes either way (token2wav's audio differs by design:
    streamed, it speaks in windows). That the talker did start early is checked too, else the
    equality would say nothing."""
    whole_yaml = tmp_path / "whole.yaml"
    text = SPEECH.read_text()
    assert "async_chunk: true" in text
    whole_yaml.write_text(text.replace("async_chunk: true", "async_chunk: false"))
    prompts = [PROMPTS[1], PROMPTS[2]]
    streamed = speech.generate(prompts)
    talker, thinker = _stage(speech, "talker"), _stage(speech, "thinker")
    early = [
        o.stage_outputs[talker].metrics["at.added"] < o.stage_outputs[thinker].metrics["at.finished"]
        for o in streamed
    ]
    assert any(early), "the talker never started before its thinker finished"
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=whole_yaml, keep_stage_outputs=True) as whole:
        for got, want in zip(streamed, whole.generate(prompts)):
            assert differences(speech, got, whole, want) == ["audio bytes"]


def test_each_voice_speaks_and_an_unknown_one_is_refused(speech):
    chelsie = speech.generate([{"prompt": PROMPTS[1], "speaker": "Chelsie"}])[0]
    ethan = speech.generate([{"prompt": PROMPTS[1], "speaker": "ethan"}])[0]
    assert chelsie.text == ethan.text and not torch.equal(chelsie.audio, ethan.audio)
    with pytest.raises(Exception, match="voice 'nobody'"):
        speech.generate([{"prompt": PROMPTS[1], "speaker": "nobody"}])
    assert _clean(speech)


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    """The colocated pipeline with the thinker's prefix cache off: what caching must not change."""
    import yaml

    data = yaml.safe_load(SPEECH.read_text())
    for stage in data["stage_args"]:
        if stage["engine_args"]["model_stage"] == "thinker":
            stage["engine_args"]["enable_prefix_caching"] = False
    path = tmp_path_factory.mktemp("uncached") / SPEECH.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with Omni(model=TINY_MODEL_NAME, stage_configs_path=path, keep_stage_outputs=True) as omni:
        yield omni


@pytest.mark.exactness
def test_conversation_turns_over_the_prefix_cache_in_pd_equal_the_uncached_pipeline(uncached, speech_pd):
    """Each turn resends the history: P/D (prefix cache on, the default) reuses the earlier turns'
    blocks on the prefill side and moves only the blocks the decode side lacks, and still equals
    the colocated pipeline without a cache in tokens, talker rows, codes and audio. The control:
    another conversation's answer, over the same cached system prompt, differs."""
    turns = _turns(3)  # the Qwen3-Omni suite's conversation
    per_token = _per_token_kv_bytes(speech_pd, "float32")  # the stage files' dtype
    wants = [uncached.generate([m])[0] for m in turns]
    for turn, (messages, want) in enumerate(zip(turns, wants)):
        got = speech_pd.generate([messages])[0]
        assert want.metrics["prefix_cached_tokens"] == 0
        assert differences(uncached, want, speech_pd, got) == [], turn
        if turn:
            before = len(wants[turn - 1].prompt_token_ids)
            assert got.metrics["prefix_cached_tokens"] >= before - 16
            reused = got.metrics["kv_reused_tokens"]
            assert reused >= before - 16
            assert got.metrics["kv_bytes_transferred"] == (len(got.prompt_token_ids) - reused) * per_token
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something else?"}]
    got = speech_pd.generate([other])[0]
    assert got.metrics["prefix_cached_tokens"] > 0  # the system prompt, shared
    assert differences(uncached, wants[1], speech_pd, got) != []
    assert _clean(speech_pd) and _clean(uncached)
