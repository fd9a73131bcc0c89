"""The Realtime API's parts without a server: client events refused by name, the turn detector
on speech and silence, the conversation's messages, and what a cut answer's listener heard."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from omni_pd.entrypoints.openai.realtime.conversation import Conversation, Item, Part, item_from_client
from omni_pd.entrypoints.openai.realtime.events import ItemIn, RealtimeError, ServerVad, parse_client_event
from omni_pd.entrypoints.openai.realtime.vad import TurnDetector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from speech import pcm16, speak  # noqa: E402

RATE = 24_000


@pytest.mark.parametrize(
    "raw, param, code",
    [
        ("{", None, "invalid_json"),
        ("[1]", "type", "invalid_event"),
        ('{"type": "response.explode"}', "type", "invalid_event"),
        ('{"type": "input_audio_buffer.append"}', "audio", "invalid_value"),
        (
            '{"type": "session.update", "session": {"modalities": ["video"]}}',
            "session.modalities.0",
            "invalid_value",
        ),
        (
            '{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}',
            "session.audio.input.format.rate",
            "invalid_value",
        ),
        (
            '{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}}',
            "session.audio.input.turn_detection.type",
            "invalid_value",
        ),
        (
            '{"type": "session.update", "session": {"tools": [{"type": "function"}]}}',
            "session.tools",
            "invalid_value",
        ),
        (
            '{"type": "conversation.item.create", "item": {"role": "user", "content": []}}',
            "item.content",
            "invalid_value",
        ),
        (
            '{"type": "conversation.item.truncate", "item_id": "a", "content_index": 0, "audio_end_ms": -1}',
            "audio_end_ms",
            "invalid_value",
        ),
    ],
)
def test_bad_client_events_are_refused_naming_the_field(raw, param, code):
    with pytest.raises(RealtimeError) as refused:
        parse_client_event(raw)
    assert refused.value.param == param and refused.value.code == code
    assert refused.value.message


def test_good_client_events_parse_ga_and_beta_names():
    ga = parse_client_event(
        json.dumps(
            {
                "type": "session.update",
                "event_id": "e",
                "session": {
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}
                    },
                },
            }
        )
    )
    assert ga.session.output_modalities == ["text"] and ga.event_id == "e"
    assert "turn_detection" in ga.session.audio.input.model_fields_set  # null: manual commits
    beta = parse_client_event(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "modalities": ["text", "audio"],
                    "voice": "ethan",
                    "input_audio_format": "pcm16",
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
                },
            }
        )
    )
    assert beta.session.turn_detection.silence_duration_ms == 300


def _detector_events(samples: np.ndarray, threshold: float = 0.8):
    detector, events, data = (
        TurnDetector(ServerVad(type="server_vad", threshold=threshold)),
        [],
        pcm16(samples),
    )
    for start in range(0, len(data), 960):
        events += detector.feed(data[start : start + 960])
    return events


def test_the_turn_detector_finds_speech_between_silences():
    speech = speak("Hello, what is the weather like today?")
    silence = np.zeros(RATE, dtype=np.float32)
    events = _detector_events(np.concatenate([silence, speech, silence]))
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]
    speech_ms = len(speech) * 1000 // RATE
    start, stop = events[0].at_ms, events[1].at_ms
    assert 1000 - 300 - 100 <= start <= 1000  # back-dated by prefix_padding_ms (300)
    assert 1000 + speech_ms - 200 <= stop <= 1000 + speech_ms + 300
    # Negative controls: silence, and quiet noise, are not speech; nor, at aggressiveness 3, a tone.
    assert _detector_events(np.concatenate([silence, silence])) == []
    noise = (np.random.default_rng(0).standard_normal(2 * RATE) * 0.002).astype(np.float32)
    assert _detector_events(noise) == []
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(2 * RATE) / RATE)).astype(np.float32)
    assert _detector_events(tone) == []


def test_a_speech_stop_needs_the_whole_silence_duration():
    speech = speak("Yes.")
    gap = np.zeros(RATE * 300 // 1000, dtype=np.float32)  # 300 ms: under the default 500
    events = _detector_events(np.concatenate([speech, gap, speech, np.zeros(RATE, np.float32)]))
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]  # one turn


def test_the_conversation_makes_chat_messages_in_order():
    conversation = Conversation()
    audio = base64.b64encode(pcm16(np.zeros(RATE // 10, np.float32))).decode()
    user = item_from_client(
        ItemIn(
            role="user",
            content=[{"type": "input_text", "text": "hi"}, {"type": "input_audio", "audio": audio}],
        )
    )
    assert user.parts[1].audio.shape == (1600,) and user.parts[1].audio_ms == 100
    conversation.add(user)
    conversation.add(Item("a1", "assistant", [Part("output_audio", transcript="hello there")]))
    conversation.add(Item("a2", "assistant", [Part("output_audio", transcript="")]))  # cut at once
    assert (
        conversation.add(Item("s", "system", [Part("input_text", text="be brief")]), previous_item_id="root")
        is None
    )
    messages = conversation.messages("You are kind.")
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant"]
    assert messages[3]["content"] == "hello there"
    assert messages[2]["content"][0] == {"type": "text", "text": "hi"}
    assert messages[2]["content"][1]["type"] == "audio"
    with pytest.raises(RealtimeError, match="a user item takes"):
        item_from_client(ItemIn(role="user", content=[{"type": "output_text", "text": "x"}]))
    with pytest.raises(RealtimeError) as bad:
        item_from_client(ItemIn(role="user", content=[{"type": "input_audio", "audio": "@@"}]))
    assert bad.value.param == "item.content[0].audio"
    with pytest.raises(RealtimeError, match="already"):
        conversation.add(Item("a1", "assistant"))


def test_a_cut_answer_keeps_the_tokens_its_audio_said():
    from omni_pd.models.qwen3_omni.pipeline import qwen3_omni_pipeline

    cut = qwen3_omni_pipeline("tiny-qwen3-omni").speech_text
    text = "Hello there, how are you today?"
    ids = cut.tokenizer.encode(text, add_special_tokens=False)
    assert cut(text, 0.0) == "" and cut(text, 100.0) == text
    heard = cut(text, 4 / 12.5)  # four codec frames: four tokens
    assert heard == cut.tokenizer.decode(ids[:4]) and text.startswith(heard) and heard != text
