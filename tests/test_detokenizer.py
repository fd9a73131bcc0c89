from omni_pd.orchestrator.detokenizer import IncrementalDetokenizer
from omni_pd.sampling import SamplingParams

IM_END = 261


def _stream(tokenizer, text, params, extra=()):
    ids = tokenizer.encode(text) + list(extra)
    detok = IncrementalDetokenizer(tokenizer, params, {IM_END})
    return [detok.add([t]) for t in ids]


def test_deltas_concatenate_to_the_text_and_hold_back_half_characters(tiny_tokenizer):
    deltas = _stream(tiny_tokenizer, "héllo wörld", SamplingParams(), extra=[IM_END])
    assert "".join(deltas) == "héllo wörld"
    assert all("\ufffd" not in d for d in deltas)  # a 2-byte character is sent whole


def test_stop_string_is_never_streamed(tiny_tokenizer):
    deltas = _stream(tiny_tokenizer, "abc STOP def", SamplingParams(stop=("STOP",)))
    assert "".join(deltas) == "abc "
    kept = _stream(
        tiny_tokenizer, "abc STOP def", SamplingParams(stop=("STOP",), include_stop_str_in_output=True)
    )
    assert "".join(kept) == "abc STOP"
