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
    out = translate(
        _req(temperature=0.7, top_p=0.5, max_completion_tokens=9, seed=3, stop="END"), DEFAULTS, "m"
    )
    assert out.thinker_params == DEFAULTS.replace(
        temperature=0.7, top_p=0.5, max_tokens=9, seed=3, stop=("END",)
    )
    assert DEFAULTS.max_tokens == 24
    assert out.modalities == ("text",)


def test_audio_modality_and_voice():
    out = translate(
        _req(modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"}), DEFAULTS, "m"
    )
    assert out.modalities == ("text", "audio") and out.prompt["speaker"] == "chelsie"


@pytest.mark.parametrize(
    "stream, audio, want",
    [
        (False, {"voice": "ethan"}, "wav"),
        (True, {"voice": "ethan"}, "pcm16"),
        (True, None, "pcm16"),
        (False, {"format": "pcm16"}, "pcm16"),
        (True, {"format": "pcm16"}, "pcm16"),
    ],
)
def test_audio_output_format_defaults_to_what_the_request_can_carry(stream, audio, want):
    out = translate(_req(stream=stream, modalities=["text", "audio"], audio=audio), DEFAULTS, "m")
    assert out.audio_format == want


def test_streaming_wav_is_refused_pointing_at_pcm16():
    with pytest.raises(APIError) as err:
        translate(
            _req(stream=True, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}),
            DEFAULTS,
            "m",
        )
    error = err.value.body.error
    assert err.value.status == 400 and error.param == "audio.format"
    assert '"pcm16"' in error.message and "stream: false" in error.message
    # Control: the same request without streaming is served.
    translate(
        _req(stream=False, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}),
        DEFAULTS,
        "m",
    )


def test_input_audio_is_decoded_and_resampled_to_16k():
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(8000, dtype=np.float32), 8000, format="WAV")
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"},
    }
    out = translate(
        _req(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]), DEFAULTS, "m"
    )
    audio = out.prompt["messages"][0]["content"][1]["audio"]
    assert audio.dtype == np.float32 and len(audio) == 16000


@pytest.mark.parametrize(
    "kw, status, param",
    [
        ({"model": "other"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"modalities": ["audio", "image"]}, 400, "modalities"),
        ({"audio": {"voice": "ethan", "format": "mp3"}}, 400, "audio.format"),
        ({"temperature": -0.1}, 400, "temperature"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"n": 2}, 400, "n"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}}],
                    }
                ]
            },
            400,
            "messages[0].content[0].input_audio.data",
        ),
        ({"temperature": float("nan")}, 400, "temperature"),
        ({"max_completion_tokens": 0, "max_tokens": 5}, 400, "max_completion_tokens"),
        ({"seed": 2**63}, 400, "seed"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": None, "format": "wav"}}],
                    }
                ]
            },
            400,
            "messages[0].content[0].input_audio.data",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "abc"}]}]},
            400,
            "messages[0].content[0].input_audio",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
            400,
            "messages[0].content[0].text",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "a\udfffb"}],
                    }
                ]
            },
            400,
            "messages[0].content[1].text",
        ),
        ({"stop": ["fine", "\ud800"]}, 400, "stop[1]"),
    ],
)
def test_each_bad_field_is_named(kw, status, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    with pytest.raises(APIError) as err:
        translate(ChatCompletionRequest.model_validate(body), DEFAULTS, "m")
    assert err.value.status == status and err.value.body.error.param == param


def _wav_b64(samples: np.ndarray, rate: int = 16000) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "samples, why",
    [(np.zeros(0, np.float32), "no samples"), (np.array([0.1, np.nan, 0.2], np.float32), "NaN")],
)
def test_input_audio_without_usable_samples_is_refused(samples, why):
    part = {"type": "input_audio", "input_audio": {"data": _wav_b64(samples), "format": "wav"}}
    with pytest.raises(APIError) as err:
        translate(_req(messages=[{"role": "user", "content": [part]}]), DEFAULTS, "m")
    assert err.value.body.error.param == "messages[0].content[0].input_audio.data"
    assert why in err.value.body.error.message


@pytest.mark.parametrize(
    "temperature, want", [(1e-300, 0.0), (5e-324, 0.0), (9.9e-6, 0.0), (1e-5, 1e-5), (0.0, 0.0), (2.0, 2.0)]
)
def test_a_temperature_below_1e_5_is_greedy_as_in_vllm(temperature, want):
    params = translate(_req(temperature=temperature), DEFAULTS.replace(temperature=1.0), "m").thinker_params
    assert params.temperature == want and params.greedy == (want == 0.0)


def test_the_temperature_error_says_what_to_send():
    with pytest.raises(APIError) as err:
        translate(_req(temperature=2.5), DEFAULTS, "m")
    assert "[0, 2]" in err.value.body.error.message and "greedy" in err.value.body.error.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("logprobs", True),
        ("logprobs", 1),
        ("top_logprobs", 3),
        ("logit_bias", {"50256": -100}),
        ("response_format", {"type": "json_object"}),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("reasoning_effort", "low"),
        ("top_k", 5),
        ("min_p", 0.1),
        ("repetition_penalty", 1.2),
        ("min_tokens", 3),
        ("best_of", 2),
        ("use_beam_search", True),
        ("echo", True),
    ],
)
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(APIError) as err:
        translate(_req(**{field: value}), DEFAULTS, "m")
    error = err.value.body.error
    assert err.value.status == 400 and error.param == field and error.code == "unsupported_parameter"
    assert f"omni-pd does not support `{field}`" in error.message


def test_n_other_than_1_is_refused_as_unsupported():
    with pytest.raises(APIError) as err:
        translate(_req(n=3), DEFAULTS, "m")
    error = err.value.body.error
    assert error.param == "n" and error.code == "unsupported_parameter" and "n: 1" in error.message


def test_unsupported_fields_at_their_defaults_and_ignored_fields_are_accepted():
    noops = dict(
        tools=[],
        tool_choice="none",
        functions=None,
        function_call="auto",
        logprobs=False,
        top_logprobs=0,
        logit_bias={},
        response_format={"type": "text"},
        frequency_penalty=0,
        presence_penalty=0.0,
        top_k=-1,
        min_p=0,
        repetition_penalty=1.0,
        min_tokens=0,
        best_of=1,
        use_beam_search=False,
        echo=False,
        n=1,
        # accepted and ignored, as by vLLM: bookkeeping, or nothing to do without tools
        user="u",
        metadata={"a": "b"},
        store=False,
        parallel_tool_calls=False,
    )
    out = translate(_req(**noops), DEFAULTS, "m")
    assert out.thinker_params == DEFAULTS
