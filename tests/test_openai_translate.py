import base64
import io

import numpy as np
import pytest
import soundfile

from omni_pd.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from omni_pd.entrypoints.openai.translate import translate
from omni_pd.sampling import SamplingParams

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=24, seed=42)


def _req(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def test_sampling_fields_override_the_stage_defaults_without_mutating_them():
    out = translate(_req(temperature=0.7, top_p=0.5, max_completion_tokens=9, seed=3, stop="END"),
                    DEFAULTS, "m")
    assert out.thinker_params == DEFAULTS.replace(temperature=0.7, top_p=0.5, max_tokens=9, seed=3,
                                                  stop=("END",))
    assert DEFAULTS.max_tokens == 24
    assert out.modalities == ("text",)


def test_audio_modality_and_voice():
    out = translate(_req(modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"}),
                    DEFAULTS, "m")
    assert out.modalities == ("text", "audio") and out.prompt["speaker"] == "chelsie"


@pytest.mark.parametrize("stream, audio, want", [
    (False, {"voice": "ethan"}, "wav"), (True, {"voice": "ethan"}, "pcm16"), (True, None, "pcm16"),
    (False, {"format": "pcm16"}, "pcm16"), (True, {"format": "pcm16"}, "pcm16"),
])
def test_audio_output_format_defaults_to_what_the_request_can_carry(stream, audio, want):
    out = translate(_req(stream=stream, modalities=["text", "audio"], audio=audio), DEFAULTS, "m")
    assert out.audio_format == want


def test_streaming_wav_is_refused_pointing_at_pcm16():
    with pytest.raises(APIError) as err:
        translate(_req(stream=True, modalities=["text", "audio"],
                       audio={"voice": "ethan", "format": "wav"}), DEFAULTS, "m")
    error = err.value.body.error
    assert err.value.status == 400 and error.param == "audio.format"
    assert '"pcm16"' in error.message and "stream: false" in error.message
    # Control: the same request without streaming is served.
    translate(_req(stream=False, modalities=["text", "audio"],
                   audio={"voice": "ethan", "format": "wav"}), DEFAULTS, "m")


def test_input_audio_is_decoded_and_resampled_to_16k():
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(8000, dtype=np.float32), 8000, format="WAV")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                                   "format": "wav"}}
    out = translate(_req(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]),
                    DEFAULTS, "m")
    audio = out.prompt["messages"][0]["content"][1]["audio"]
    assert audio.dtype == np.float32 and len(audio) == 16000


@pytest.mark.parametrize("kw, status, param", [
    ({"model": "other"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"modalities": ["audio", "image"]}, 400, "modalities"),
    ({"audio": {"voice": "ethan", "format": "mp3"}}, 400, "audio.format"),
    ({"temperature": -0.1}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "!!", "format": "wav"}}]}]},
     400, "messages[0].content[0].input_audio.data"),
])
def test_each_bad_field_is_named(kw, status, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    with pytest.raises(APIError) as err:
        translate(ChatCompletionRequest.model_validate(body), DEFAULTS, "m")
    assert err.value.status == status and err.value.body.error.param == param
