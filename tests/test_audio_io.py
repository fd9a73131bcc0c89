import numpy as np
import pytest
import torch

from omni_pd.audio_io import (
    DUMMY_WEIGHTS_PCM16_GAIN,
    PCM16_SAMPLE_RATE,
    pcm16_bytes,
    pcm16_gain,
    stage_config_pcm16_gain,
    to_pcm16,
)
from omni_pd.config import load_pipeline_config
from omni_pd.paths import STAGE_CONFIGS_DIR


def _waveform(n: int = 10_000) -> torch.Tensor:
    # Random-weight-like amplitudes (about 1e-6) so the gain matters, some past full scale.
    return torch.randn(n, generator=torch.Generator().manual_seed(0)) * 6e-7


def test_chunks_converted_one_by_one_equal_the_whole():
    audio, gain = _waveform(), DUMMY_WEIGHTS_PCM16_GAIN
    whole = to_pcm16(audio, gain)
    pieces = torch.cat([to_pcm16(c, gain) for c in torch.split(audio, [1, 999, 4000, 5000])])
    assert whole.dtype == torch.int16 and torch.equal(pieces, whole)
    joined = b"".join(pcm16_bytes(c, PCM16_SAMPLE_RATE, gain) for c in torch.split(audio, 3333))
    assert joined == pcm16_bytes(audio, PCM16_SAMPLE_RATE, gain)

    # Negative controls: a chunk-dependent conversion (each chunk scaled to its own peak) and
    # another gain are noticed by the same comparison.
    def normalised(x: torch.Tensor) -> torch.Tensor:
        return to_pcm16(x / x.abs().max())

    chunked = torch.cat([normalised(c) for c in torch.split(audio, 3333)])
    assert chunked.numel() == audio.numel() and not torch.equal(chunked, normalised(audio))
    assert not torch.equal(to_pcm16(audio, gain * 1.01), whole)


def test_rounding_and_clipping():
    x = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 1e-6, 0.2 / 32767, 0.7 / 32767])
    got = to_pcm16(x).tolist()
    assert got == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 0, 1]
    assert to_pcm16(torch.tensor([1e-6]), 5e5).tolist() == [round(0.5 * 32767)]


def test_bytes_are_little_endian_int16():
    raw = pcm16_bytes(torch.tensor([1.0, -1.0, 256 / 32767]), PCM16_SAMPLE_RATE)
    assert raw == b"\xff\x7f" + b"\x01\x80" + b"\x00\x01"
    assert np.frombuffer(raw, dtype="<i2").tolist() == [32767, -32767, 256]


def test_other_sample_rates_are_refused_by_name():
    with pytest.raises(RuntimeError, match="24000 Hz"):
        pcm16_bytes(torch.zeros(4), 16_000)


def test_gain_follows_the_audio_stage_load_format():
    assert pcm16_gain("dummy") == DUMMY_WEIGHTS_PCM16_GAIN and pcm16_gain("auto") == 1.0
    for name in ("qwen3_omni_tiny.yaml", "qwen3_omni_tiny_pd.yaml"):
        stages = load_pipeline_config(STAGE_CONFIGS_DIR / "ci" / name).stages
        assert stage_config_pcm16_gain(stages) == DUMMY_WEIGHTS_PCM16_GAIN
    real = load_pipeline_config(STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml").stages
    assert stage_config_pcm16_gain(real) == 1.0


def _riff_chunks(data: bytes) -> list[bytes]:
    """The chunk ids of a RIFF/WAVE file, in order."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    ids, at = [], 12
    while at + 8 <= len(data):
        ids.append(data[at : at + 4])
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        at += 8 + size + (size & 1)
    return ids


def test_a_wav_is_a_function_of_its_samples(tmp_path):
    """Identical answers are identical files: no PEAK chunk (libsndfile stamps it with the time
    of writing), whether written at once, in chunks, or to memory."""
    import io

    import soundfile

    from omni_pd.audio_io import open_wav, write_wav

    audio = _waveform(4800)
    whole = write_wav(tmp_path / "a.wav", audio, 24000).read_bytes()
    buffer = io.BytesIO()
    write_wav(buffer, audio, 24000)
    with open_wav(tmp_path / "b.wav", 24000) as wav:
        for piece in torch.split(audio, 1000):
            wav.write(piece.numpy())
    assert b"PEAK" not in _riff_chunks(whole)
    assert buffer.getvalue() == whole == (tmp_path / "b.wav").read_bytes()
    samples, rate = soundfile.read(io.BytesIO(whole), dtype="float32")
    assert rate == 24000 and np.array_equal(samples, audio.numpy())
    # Negative control: libsndfile's default float WAV carries the timestamped PEAK chunk.
    plain = io.BytesIO()
    soundfile.write(plain, audio.numpy(), 24000, format="WAV", subtype="FLOAT")
    assert b"PEAK" in _riff_chunks(plain.getvalue())


def test_a_model_whose_tiny_decoder_is_heard_sets_its_own_dummy_gain():
    from omni_pd.audio_io import pcm16_gain

    assert pcm16_gain("dummy") == DUMMY_WEIGHTS_PCM16_GAIN
    assert pcm16_gain("dummy", 1.0) == 1.0  # Qwen2.5-Omni's tiny vocoder (models/qwen2_5_omni)
    assert pcm16_gain("auto", 7.0) == 1.0  # real weights: full scale already
