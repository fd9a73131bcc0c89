import dataclasses

import numpy as np
import pytest
import torch

from omni_pd.orchestrator.async_omni import AudioDelta, Finished, TextDelta
from omni_pd.orchestrator.omni import Omni
from omni_pd.sampling import SamplingParams

from omni_pd.paths import STAGE_CONFIGS_DIR

TINY_CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"


@pytest.fixture(scope="module")
def omni():
    with Omni(model="tiny-qwen3-omni", stage_configs_path=TINY_CONFIG, keep_stage_outputs=True) as o:
        yield o


def test_generate_returns_text_tokens_and_24khz_float_audio(omni):
    out = omni.generate("Tell me about the sea.")[0]
    assert out.token_ids and len(out.token_ids) <= 24
    assert out.text == omni.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.sample_rate == 24_000 and out.audio.dtype == torch.float32
    talker_frames = out.stage_outputs[1].codes.shape[1]
    assert talker_frames > 0 and out.audio.numel() > (talker_frames - 1) * 1920
    assert out.metrics["ttft_ms"] > 0 and out.metrics["e2e_ms"] >= out.metrics["ttft_ms"]
    assert set(out.metrics["stage_ms"]) == {"0", "1", "2"}
    assert all(v == 0 for v in omni.debug_state_counts().values())


def test_batch_greedy_is_deterministic_and_per_prompt(omni):
    outs = omni.generate(["first prompt", "a second, different prompt", "first prompt"])
    assert outs[0].token_ids == outs[2].token_ids and outs[0].audio_sha256 == outs[2].audio_sha256
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids
    assert len({o.request_id for o in outs}) == 3


def test_sampling_params_list_overrides_stage_defaults(omni):
    short = omni.generate("hello", [SamplingParams(temperature=0, max_tokens=3), None, None])[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_a_text_only_request_carries_no_rows_and_the_same_answer(omni):
    """Issue 48, item 5: nothing reads a text-only request's thinker rows, so its output carries
    none; the control, the same request with speech, carries the prompt's and output's rows, and
    the tokens and text are the same."""
    params = [SamplingParams(temperature=0, max_tokens=8), None, None]
    with_speech = omni.generate("Rows or not.", params)[0]
    text_only = omni._call(omni.engine.generate("Rows or not.", params, modalities=("text",)))
    assert text_only.token_ids == with_speech.token_ids and text_only.text == with_speech.text
    fields = ("prompt_embeds", "prompt_hidden", "output_embeds", "output_hidden")
    assert all(getattr(text_only.stage_outputs[0], f) is None for f in fields)
    full = with_speech.stage_outputs[0]
    assert full.prompt_embeds.shape[0] == len(full.prompt_token_ids)
    assert full.output_embeds.shape[0] == len(full.token_ids) - 1
    assert all(v == 0 for v in omni.debug_state_counts().values())


def test_audio_input_changes_the_prompt(omni):
    tone = (0.1 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    msg = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this"}, {"type": "audio", "audio": tone}],
        }
    ]
    out = omni.generate([msg])[0]
    audio_id = omni.model_config.thinker_config.audio_token_id
    assert out.prompt_token_ids.count(audio_id) > 1


def test_failed_request_leaves_no_state(omni):
    with pytest.raises(ValueError, match="audio part"):
        omni.generate({"messages": [{"role": "user", "content": [{"type": "audio"}]}], "audios": []})
    assert all(v == 0 for v in omni.debug_state_counts().values())


def test_stream_deltas_add_up_to_generate(omni):
    params = [SamplingParams(temperature=0, max_tokens=8), None, None]
    want = omni.generate("Stream to me.", params)[0]
    events = list(omni.stream("Stream to me.", params))
    assert isinstance(events[-1], Finished)
    assert all(isinstance(e, (TextDelta, AudioDelta)) for e in events[:-1])
    text = [e.text for e in events if isinstance(e, TextDelta)]
    audio = [e.audio for e in events if isinstance(e, AudioDelta)]
    assert "".join(text) == want.text == events[-1].output.text
    assert {e.sample_rate for e in events if isinstance(e, AudioDelta)} == {want.sample_rate}
    assert torch.equal(torch.cat(audio), want.audio)
    assert torch.equal(events[-1].output.audio, want.audio)
    chunks = list(omni.audio_chunks("Stream to me.", params))
    assert all(c.dtype == torch.float32 for c in chunks)
    assert torch.equal(torch.cat(chunks), want.audio)
    # Negative control: without one audio delta, or with one sample changed, it differs.
    assert not torch.equal(torch.cat([torch.zeros(0), *audio[:-1]]), want.audio)
    changed = torch.cat(audio).clone()
    changed[changed.numel() // 2] = torch.nextafter(changed[changed.numel() // 2], torch.tensor(1.0))
    assert not torch.equal(changed, want.audio)
    assert all(v == 0 for v in omni.debug_state_counts().values())


def test_closing_a_stream_early_aborts_the_request_and_leaves_no_state(omni):
    params = [SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), None, None]
    events = omni.stream("A long answer, please.", params)
    assert isinstance(next(events), TextDelta)
    counts = omni.debug_state_counts()
    assert counts["orchestrator.requests"] == 1  # control: it was in flight
    events.close()
    assert all(v == 0 for v in omni.debug_state_counts().values())
    chunks = omni.audio_chunks("Speak.", [SamplingParams(temperature=0, max_tokens=4), None, None])
    assert next(chunks).numel() > 0
    chunks.close()
    assert all(v == 0 for v in omni.debug_state_counts().values())


def test_closed_omni_refuses_work():
    o = Omni(stage_configs_path=TINY_CONFIG)
    o.close()
    with pytest.raises(RuntimeError, match="closed"):
        o.generate("hi")


def test_a_prepared_prompt_is_built_once(omni, monkeypatch):
    """The server builds a request's prompt in its thread (to check its length) and hands it on:
    the orchestrator must not tokenize it again."""
    engine = omni.engine
    prepared = engine.prepare("Hi there")
    built = []
    original = engine.pipeline.build_prompt
    monkeypatch.setattr(
        engine,
        "pipeline",
        dataclasses.replace(engine.pipeline, build_prompt=lambda p: built.append(p) or original(p)),
    )
    out = omni._call(engine.generate(prepared, modalities=("text",)))
    assert built == [] and out.prompt_token_ids == prepared.text_prompt.prompt_token_ids
    omni._call(engine.generate("Hi there", modalities=("text",)))  # control: a plain prompt is built
    assert len(built) == 1


def test_pd_streams_the_prefill_legs_first_token_before_the_handoff():
    """P/D: the first token leaves when the prefill leg has it, before the decode leg starts (the
    KV handoff is not on the time to first token); the decode leg's stream, which starts with the
    same token, adds the rest, and the deltas add up to the whole answer, token for token as
    colocated."""
    params = [SamplingParams(temperature=0, max_tokens=12), None, None]
    pd_params = [params[0], params[0], None, None]
    with Omni(stage_configs_path=TINY_CONFIG) as colocated:
        want = list(colocated.stream("Stream to me.", params, modalities=["text"]))[-1].output
    with Omni(stage_configs_path=STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml") as pd:
        events = list(pd.stream("Stream to me.", pd_params, modalities=["text"]))
        finished = events[-1].output
        text = [e.text for e in events if isinstance(e, TextDelta)]
        assert "".join(text) == finished.text == want.text and finished.token_ids == want.token_ids
        assert finished.metrics["ttft_ms"] <= finished.metrics["timeline"]["stages"]["1"]["start_ms"]
        assert all(v == 0 for v in pd.debug_state_counts().values())
