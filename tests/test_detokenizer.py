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


class _WholeListDetokenizer:
    """The reference: the whole token list decoded again at every step (what the incremental
    detokenizer replaced; quadratic in the answer's length)."""

    def __init__(self, tokenizer, params, hidden):
        self.tokenizer, self.params, self.hidden = tokenizer, params, set(hidden) | set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token_ids):
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(
            [t for t in self.tokens if t not in self.hidden], skip_special_tokens=True
        )
        for stop in self.params.stop:
            if stop and stop in text:
                text = text[: text.index(stop) + (len(stop) if self.params.include_stop_str_in_output else 0)]
        stable = len(text.rstrip("\ufffd"))
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, stable), 0, -1):
                if text[:stable].endswith(stop[:n]):
                    stable -= n
                    break
        if not text.startswith(self.sent) or stable <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) : stable], text[:stable]
        return delta


def _random_case(rng, tokenizer):
    """Random ids (bytes that make whole and broken UTF-8, specials, the end token) and stops."""
    vocab = len(tokenizer)
    words = [tokenizer.encode(w) for w in ("é", "中", "😀", "ab", " STOP", "S", "TO", "P\n", "\n")]
    ids: list[int] = []
    while len(ids) < rng.randint(1, 120):
        roll = rng.random()
        ids += rng.choice(words) if roll < 0.5 else [rng.randrange(vocab)]
    stops = rng.sample(["STOP", "TO", "\n\n", "中😀", "zz"], rng.randint(0, 2))
    params = SamplingParams(stop=tuple(stops), include_stop_str_in_output=rng.random() < 0.5)
    return ids, params


def test_the_incremental_deltas_are_the_whole_list_decodes_on_random_ids(tiny_tokenizer):
    import random

    rng = random.Random(0)
    for case in range(300):
        ids, params = _random_case(rng, tiny_tokenizer)
        ours = IncrementalDetokenizer(tiny_tokenizer, params, {IM_END})
        reference = _WholeListDetokenizer(tiny_tokenizer, params, {IM_END})
        at = 0
        while at < len(ids):  # one token, or several (a step's tokens arrive together)
            step = ids[at : at + rng.choice((1, 1, 1, 2, 5))]
            at += len(step)
            assert ours.add(step) == reference.add(step), (case, ids, params)


def test_negative_control_a_context_free_window_is_caught(tiny_tokenizer, monkeypatch):
    """Decoding each new run with no context before it (and so mid-character) is noticed."""
    import random

    def no_context(self):
        if len(self.ids) == self.read:
            return self.final
        tail = self._decode(self.ids[self.read - 1 if self.read else 0 :])[1 if self.read else 0 :]
        if tail and not tail.endswith("\ufffd"):
            self.final += tail
            self.read = len(self.ids)
            return self.final
        return self.final + tail

    monkeypatch.setattr(IncrementalDetokenizer, "_text", no_context)
    rng, differ = random.Random(0), False
    for _ in range(100):
        ids, params = _random_case(rng, tiny_tokenizer)
        ours = IncrementalDetokenizer(tiny_tokenizer, params, {IM_END})
        reference = _WholeListDetokenizer(tiny_tokenizer, params, {IM_END})
        differ |= any(ours.add([t]) != reference.add([t]) for t in ids)
    assert differ
