"""Qwen2.5-Omni's token2wav (issue 49): a whole utterance is transformers' token2wav on the same
weights and noise; a streamed one is windowed, and the same bits however its codes arrive; bad
input is refused by name."""

import pytest
import torch

torch.set_num_threads(1)

from omni_pd.engines.core.chunked import ChunkedEngine
from omni_pd.models.qwen2_5_omni import factory
from omni_pd.models.qwen2_5_omni.hf.token2wav import FUTURE, WINDOW, Token2Wav, WindowedStream, conditioning
from omni_pd.models.qwen2_5_omni.hf.token2wav_runner import Token2WavRunner
from omni_pd.models.qwen2_5_omni.records import Token2WavPrompt
from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME
from omni_pd.sampling import SamplingParams

# Not in the older-ISA rerun: windowed = streamed holds by construction (the same calls on the
# same shapes), and the comparison with transformers runs the same modules either way.
STEPS = 4  # ODE steps: fewer than the default 10, the same code path


@pytest.fixture(scope="module")
def model():
    return factory.build_dummy_model(factory.load_config(factory.resolve_model(TINY_MODEL_NAME)), seed=42)


def _codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_whole_utterance_is_transformers_token2wav(model, monkeypatch):
    """transformers draws the ODE's starting noise with one `torch.randn` from the global
    generator; handed the same noise, its samples are ours bit for bit (the same modules in the
    same order: no float tolerance is needed)."""
    t2w = Token2Wav(model.token2wav, seed=3, num_steps=STEPS)
    voice = conditioning(model.speaker_map, "Ethan")
    codes = _codes(50, 1)
    ours = t2w.whole(codes, voice)
    assert ours.numel() == 50 * 480 and 0.05 < float(ours.abs().max()) <= 1.0  # audible, in range
    frames, real = 100, torch.randn

    def same_noise(*shape, **kwargs):
        size = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else list(shape)
        return t2w.noise(0, frames) if size == [1, frames, 80] else real(*shape, **kwargs)

    monkeypatch.setattr(torch, "randn", same_noise)
    with torch.no_grad():
        theirs = model.token2wav(codes.view(1, -1), voice.cond, voice.ref_mel, num_steps=STEPS).reshape(-1)
    monkeypatch.setattr(torch, "randn", real)
    assert torch.equal(ours, theirs)
    # Negative control: another seed's noise is other audio.
    assert not torch.equal(Token2Wav(model.token2wav, seed=4, num_steps=STEPS).whole(codes, voice), theirs)


def _streamed(runner, codes, voice, first, later):
    engine = ChunkedEngine(0, runner, initial_chunk_frames=first, chunk_frames=later)
    engine.add_request(
        "r", Token2WavPrompt("r", codes[:0], speaker=voice, final=False), SamplingParams(), stream=True
    )
    pieces, sent = [], 0
    while True:
        while sent < len(codes) and not engine.has_unfinished_requests():
            step = min(later, len(codes) - sent)
            engine.append_input("r", codes[sent : sent + step], final=sent + step == len(codes))
            sent += step
        outs = engine.step()
        for out in outs:
            assert out.error is None, out.error
            if out.chunk is not None:
                pieces.append(out.chunk.audio)
        if any(out.finished for out in outs):
            break
    assert engine.debug_state_counts() == {"code2wav.requests": 0}
    return torch.cat(pieces)


def test_streamed_audio_is_the_same_however_the_codes_arrive(model):
    t2w = Token2Wav(model.token2wav, seed=3, num_steps=STEPS)
    runner = Token2WavRunner(t2w, model.speaker_map, "Chelsie")
    codes = _codes(130, 2)  # 260 mel frames: four windows
    at_once = t2w.feed(WindowedStream(conditioning(model.speaker_map, "chelsie")), codes.tolist(), final=True)
    assert at_once.numel() == 130 * 480
    for first, later in ((1, 1), (48, 36), (5, 7)):
        assert torch.equal(_streamed(runner, codes, "chelsie", first, later), at_once), (first, later)
    # Negative controls: another seed's noise, and another voice, are other audio.
    other = Token2WavRunner(Token2Wav(model.token2wav, seed=4, num_steps=STEPS), model.speaker_map, "Chelsie")
    assert not torch.equal(_streamed(other, codes, "chelsie", 48, 36), at_once)
    assert not torch.equal(_streamed(runner, codes, "ethan", 48, 36), at_once)


def test_an_utterance_of_one_window_streams_to_the_whole_utterances_samples(model):
    t2w = Token2Wav(model.token2wav, seed=3, num_steps=STEPS)
    voice = conditioning(model.speaker_map, "Chelsie")
    short = _codes(WINDOW // 2, 5)  # one window: its own span is the whole utterance
    assert torch.equal(t2w.feed(WindowedStream(voice), short.tolist(), final=True), t2w.whole(short, voice))
    longer = _codes((WINDOW + FUTURE) // 2 + 30, 5)  # past it, the windowed ODE is another one
    assert not torch.equal(
        t2w.feed(WindowedStream(voice), longer.tolist(), final=True), t2w.whole(longer, voice)
    )


def test_bad_codes_and_voices_are_refused_by_name(model):
    runner = Token2WavRunner(Token2Wav(model.token2wav, num_steps=STEPS), model.speaker_map, "Chelsie")
    with pytest.raises(ValueError, match="outside token2wav's codec vocabulary"):
        runner.check_units("r", torch.tensor([1, 999]))
    with pytest.raises(ValueError, match=r"\[frames\] or \[1, frames\]"):
        runner.check_units("r", torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="voice 'nobody'"):
        runner.new_stream(Token2WavPrompt("r", torch.tensor([1]), speaker="nobody"))
