"""Talk to an omni-pd server over the Realtime API: send a WAV file as your turn, write the
spoken answer to a WAV file, print its transcript.

    .venv/bin/omni-pd serve tiny-qwen3-omni &        # wait for GET /health to answer 200
    .venv/bin/python examples/realtime_client.py question.wav answer.wav

`--vad` lets the server's turn detection end the turn (the file is streamed in 20 ms chunks
followed by a second of silence, as a microphone would send it); without it the turn is
committed by hand.
"""

from __future__ import annotations

import argparse
import base64
import os

import librosa
import numpy as np
import soundfile
from openai import OpenAI

RATE = 24_000  # the Realtime API's pcm16: 24 kHz mono little-endian int16


def pcm16_chunks(path: str, chunk_ms: int) -> list[bytes]:
    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    mono = librosa.resample(samples.mean(axis=1), orig_sr=rate, target_sr=RATE)
    data = (np.clip(mono, -1, 1) * 32767).round().astype("<i2").tobytes()
    step = RATE * 2 * chunk_ms // 1000
    return [data[i : i + step] for i in range(0, len(data), step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", help="a WAV (or FLAC/OGG) file: your turn")
    parser.add_argument("answer", help="where to write the spoken answer (a 24 kHz WAV)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny-qwen3-omni")
    parser.add_argument("--instructions", default="Answer briefly.")
    parser.add_argument("--vad", action="store_true", help="let server_vad end the turn")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OMNI_PD_API_KEY", "unused"))
    with client.realtime.connect(model=args.model) as conn:
        turn_detection = {"type": "server_vad"} if args.vad else None
        conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "instructions": args.instructions,
                "audio": {"input": {"turn_detection": turn_detection}},
            }
        )
        chunks = pcm16_chunks(args.question, 20 if args.vad else 200)
        if args.vad:
            chunks += [bytes(RATE * 2 // 50)] * 50  # a second of silence ends the turn
        for chunk in chunks:
            conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
        if not args.vad:
            conn.input_audio_buffer.commit()
            conn.response.create()
        audio, transcript = bytearray(), []
        for event in conn:
            if event.type == "error":
                raise SystemExit(f"error: {event.error.message}")
            if event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)
            elif event.type == "response.output_audio_transcript.delta":
                transcript.append(event.delta)
            elif event.type == "response.done":
                print(f"status: {event.response.status}; usage: {event.response.usage}")
                break
    soundfile.write(args.answer, np.frombuffer(bytes(audio), dtype="<i2"), RATE, subtype="PCM_16")
    print(f"transcript: {''.join(transcript)!r}")
    print(f"wrote {args.answer}: {len(audio) // 2 / RATE:.2f} s of audio")


if __name__ == "__main__":
    main()
