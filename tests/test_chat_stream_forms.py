"""The streamed chat chunks' `modality` key and their two audio forms (issue 48, item 8): every
chunk names its modality, as vllm-omni's server does, so vllm-omni's streaming clients can sort
them; audio goes OpenAI's way by default (delta.audio, base64 pcm16) and vllm-omni's way behind
`--stream-audio-form vllm-omni` (delta.content, a base64 16-bit WAV per chunk, the choice's
audio_metadata). Read back as vllm-omni's benchmark client reads a stream (its
`async_request_openai_chat_omni_completions`: dispatch on `modality`, audio content decoded with
Python's `wave`)."""

from __future__ import annotations

import base64
import io
import json
import wave
from types import SimpleNamespace

import pytest
import torch

from omni_pd.audio_io import to_pcm16
from omni_pd.entrypoints.openai.chat_stream import _ChunkStream
from omni_pd.orchestrator.async_omni import AudioDelta

RATE = 24_000
TONE = 0.3 * torch.sin(torch.arange(3000) / RATE * 2 * torch.pi * 440)
OUTPUT = SimpleNamespace(finish_reason="stop", prompt_token_ids=[1, 2, 3], token_ids=[4, 5], metrics={})


def _stream(form: str) -> list[dict]:
    """The chunks of an answer: text, audio, text, audio, the end with usage."""
    chunks = _ChunkStream("chatcmpl-x", 0, "m", form)
    lines = [
        chunks.text(""),  # a first token whose text is held back
        chunks.text("Hello"),
        chunks.audio(AudioDelta(TONE[:1000], RATE), 1.0),
        chunks.text(" there"),
        chunks.audio(AudioDelta(TONE[1000:], RATE), 1.0),
        *chunks.finished(OUTPUT, include_usage=True),
    ]
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def _read_like_vllm_omni(payloads: list[dict]) -> dict:
    """vllm-omni 0.30's client, the parts that read modality, text and audio."""
    text, events, pcm = "", [], b""
    for data in payloads:
        if not data.get("choices"):
            continue
        delta = data["choices"][0].get("delta") or {}
        content = delta.get("content")
        if not content and isinstance(delta.get("audio"), dict):
            content = delta["audio"].get("data")
        if data.get("modality") == "text":
            events.append("text")
            text += content or ""
        elif data.get("modality") == "audio":
            events.append("audio")
            if content:
                with wave.open(io.BytesIO(base64.b64decode(content)), "rb") as wav:
                    assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, RATE)
                    pcm += wav.readframes(wav.getnframes())
    return {"text": text, "events": events, "pcm": pcm}


@pytest.mark.parametrize("form", ["openai", "vllm-omni"])
def test_every_chunk_names_its_modality(form):
    payloads = _stream(form)
    assert all(p["modality"] in ("text", "audio") for p in payloads)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    audio = [p for p in payloads if p["modality"] == "audio"]
    assert all("audio" in p["choices"][0]["delta"] or "content" in p["choices"][0]["delta"] for p in audio)


def test_vllm_omnis_client_reads_the_vllm_omni_form_whole():
    payloads = _stream("vllm-omni")
    read = _read_like_vllm_omni(payloads)
    assert read["text"] == "Hello there"
    assert read["events"][:5] == ["text", "text", "audio", "text", "audio"]
    assert read["pcm"] == to_pcm16(TONE).numpy().astype("<i2").tobytes()  # every sample, in order
    metadata = [p["choices"][0]["audio_metadata"] for p in payloads if p["modality"] == "audio"]
    assert metadata == [
        {"format": "wav", "sample_rate_hz": RATE, "frame_count": n, "channels": 1} for n in (1000, 2000)
    ]


def test_the_openai_form_is_unchanged_and_vllm_omnis_wave_reader_refuses_it():
    """The default keeps OpenAI's audio (delta.audio, raw pcm16, transcripts, the last chunk's
    expires_at); the control: vllm-omni's client cannot read it as WAV, which is why the other
    form exists."""
    payloads = _stream("openai")
    audio = [p["choices"][0]["delta"]["audio"] for p in payloads if p["modality"] == "audio"]
    assert [a.get("transcript") for a in audio] == ["Hello", " there", None]
    assert "expires_at" in audio[-1] and all("content" not in p["choices"][0]["delta"] for p in payloads[2:3])
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio[:2])
    assert pcm == to_pcm16(TONE).numpy().astype("<i2").tobytes()
    with pytest.raises(wave.Error):
        _read_like_vllm_omni(payloads)


def test_an_unknown_form_is_refused_by_name():
    with pytest.raises(ValueError, match="audio form must be one of"):
        _ChunkStream("chatcmpl-x", 0, "m", "mp3")


class _Replay:
    """A bench client whose chat stream replays `payloads`, each as it would arrive."""

    def __init__(self, payloads: list[dict]):
        self.payloads = payloads
        self.chat = self

    async def stream(self, body: dict):
        import time

        for payload in self.payloads:
            yield time.perf_counter(), payload


@pytest.mark.parametrize("form", ["openai", "vllm-omni"])
def test_omni_pds_bench_client_reads_both_forms_alike(form):
    """`omni-pd bench serve`'s client measures either form the same way: the text without the
    audio, the first audio, and the seconds of audio (for the RTF, as vllm-omni's client defines
    it: the last audio chunk's time over them). The same answer read in both forms gives the same
    figures; in vllm-omni's form a WAV in `delta.content` would otherwise be taken for text."""
    import asyncio

    from omni_pd.bench.load import stream_one

    record = asyncio.run(stream_one(_Replay(_stream(form)), "m", "hi", 8))
    assert record.ok and record.text == "Hello there"
    assert record.ttft_s is not None and record.ttfa_s is not None and record.ttfa_s >= record.ttft_s
    assert record.audio_s == pytest.approx(3000 / RATE)
    assert record.rtf is not None and record.rtf > 0
