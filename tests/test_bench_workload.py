"""`omni-pd bench serve`'s seeded mixed-length workload (--prompt-tokens / --output-tokens
uniform:LO:HI) and its text-only mode (--text-only): the length flags and their refusals, the
drawn sequence (reproducible by --seed, a prefix per level), prompts of exactly the drawn
lengths, requests that carry their own max_tokens and, text-only, modalities ["text"] alone."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from omni_pd.bench.load import run_level, stream_one
from omni_pd.bench.serve import TEXT_ONLY_CONFIGS, _checked_args, _targets, add_arguments
from omni_pd.bench.serve_target import Requests
from omni_pd.bench.stats import RequestRecord, summarize_level
from omni_pd.bench.workload import Lengths, Workload, parse_lengths, workload_from_args
from omni_pd.config import load_pipeline_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


# --- the length flags ----------------------------------------------------------------------------


def test_lengths_take_a_number_or_uniform_bounds_and_print_back_as_given():
    assert parse_lengths("24", "--output-tokens") == Lengths(24, 24)
    assert parse_lengths("uniform:8:32", "--prompt-tokens", 8) == Lengths(8, 32)
    assert parse_lengths("uniform:5:5", "--output-tokens") == Lengths(5, 5)
    assert str(Lengths(8, 32)) == "uniform:8:32" and str(Lengths(24, 24)) == "24"


@pytest.mark.parametrize(
    "text",
    ["", "x", "uniform", "uniform:8", "uniform:32:8", "normal:8:32", "uniform:8:32:64", "8.5", "0", "-3"],
)
def test_a_bad_length_is_refused_naming_the_flag_and_the_forms(text):
    with pytest.raises(SystemExit) as refused:
        parse_lengths(text, "--output-tokens")
    message = str(refused.value)
    assert message.startswith("error: --output-tokens takes N or uniform:LO:HI") and repr(text) in message
    assert "\n" not in message


def test_prompt_lengths_below_the_numbered_prefix_are_refused():
    with pytest.raises(SystemExit, match="--prompt-tokens takes .* at least 8; got 'uniform:4:32'"):
        workload_from_args(_args("--prompt-tokens", "uniform:4:32"))
    assert workload_from_args(_args("--prompt-tokens", "uniform:8:32")).prompt == Lengths(8, 32)


def test_max_tokens_and_output_tokens_are_refused_together_and_each_works_alone():
    with pytest.raises(SystemExit, match="--max-tokens and --output-tokens both set"):
        workload_from_args(_args("--max-tokens", "8", "--output-tokens", "uniform:2:6"))
    assert workload_from_args(_args("--max-tokens", "8")).output == Lengths(8, 8)
    assert workload_from_args(_args("--output-tokens", "uniform:2:6")).output == Lengths(2, 6)
    default = workload_from_args(_args())
    assert (default.output, default.prompt, default.listed) == (Lengths(24, 24), None, False)
    with pytest.raises(SystemExit, match="--max-tokens must be >= 1"):
        workload_from_args(_args("--max-tokens", "0"))


def test_length_flags_are_refused_with_multi_turn_which_sends_its_own_turns():
    with pytest.raises(SystemExit, match="--multi-turn sends its own conversation turns"):
        workload_from_args(_args("--multi-turn", "3", "--output-tokens", "uniform:2:6"))
    with pytest.raises(SystemExit, match="--multi-turn sends its own conversation turns"):
        workload_from_args(_args("--multi-turn", "3", "--prompt-tokens", "64"))


# --- the drawn sequence --------------------------------------------------------------------------


def test_the_same_seed_draws_the_same_lengths_and_another_seed_others():
    workload = Workload(Lengths(8, 32), Lengths(2, 6), seed=0)
    pairs = workload.pairs(200)
    assert pairs == Workload(Lengths(8, 32), Lengths(2, 6), seed=0).pairs(200)
    assert pairs != Workload(Lengths(8, 32), Lengths(2, 6), seed=1).pairs(200)  # negative control
    # every level sends a prefix: request i is the same at every level and in every config
    assert workload.pairs(4) == pairs[:4]
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert set(outputs) == {2, 3, 4, 5, 6}  # both bounds inclusive, nothing outside
    assert min(prompts) == 8 and max(prompts) == 32 and len(set(prompts)) > 10


def test_the_lengths_are_not_the_arrivals_draws():
    # The arrivals use random.Random(seed); the lengths have their own stream, so a request's
    # length does not follow from its arrival gap.
    import random

    rng = random.Random(0)
    same_stream = [(rng.randint(8, 32), rng.randint(2, 6)) for _ in range(50)]
    assert Workload(Lengths(8, 32), Lengths(2, 6), seed=0).pairs(50) != same_stream


def test_a_fixed_workload_draws_the_fixed_lengths_and_describes_them():
    workload = Workload(None, Lengths(24, 24), seed=3)
    assert workload.pairs(3) == [(None, 24)] * 3
    described = Workload(Lengths(8, 32), Lengths(2, 6), seed=0, listed=True).describe(16)
    pairs = Workload(Lengths(8, 32), Lengths(2, 6), seed=0).pairs(16)
    assert described["prompt_tokens"] == "uniform:8:32" and described["output_tokens"] == "uniform:2:6"
    assert described["seed"] == 0 and described["requests"] == 16
    drawn = described["output_tokens_drawn"]
    outputs = [o for _, o in pairs]
    assert (drawn["min"], drawn["max"]) == (min(outputs), max(outputs))
    assert drawn["mean"] == pytest.approx(sum(outputs) / 16)
    assert described["prompt_tokens_drawn"]["max"] == max(p for p, _ in pairs)
    assert workload.describe(3)["prompt_tokens_drawn"] is None  # the short varied prompts


def test_prompts_have_exactly_the_drawn_lengths_and_no_shared_prefix():
    from omni_pd.bench.sized_prompts import load_tokenizer

    tokenizer = load_tokenizer("tiny-qwen3-omni")
    workload = Workload(Lengths(8, 40), Lengths(2, 6), seed=5, listed=True)
    requests = Requests(workload, "tiny-qwen3-omni")
    first, second = requests.next(12), requests.next(12)
    pairs = workload.pairs(12)
    for batch in (first, second):  # request i of each batch: the i-th drawn lengths
        assert batch.prompt_tokens == [p for p, _ in pairs] and batch.max_tokens == [o for _, o in pairs]
        lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in batch.prompts]
        assert lengths == batch.prompt_tokens
    made = first.prompts + second.prompts
    assert len({p.split(".")[0] for p in made}) == 24  # each begins with its own number
    assert made[12].startswith("Request 12.")  # numbered on, not again from 0


# --- requests with their own max_tokens; text only ------------------------------------------------


class _Client:
    """A bench client stand-in: records each chat request's body and streams `max_tokens` chunks."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.chat = self

    def chunks(self, body: dict) -> list[dict]:
        n = body["max_tokens"]
        chunks: list[dict] = [
            {"choices": [{"delta": {"content": "x"}, "finish_reason": "length" if i == n - 1 else None}]}
            for i in range(n)
        ]
        return chunks + [{"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": n + 10}}]

    async def stream(self, body: dict):
        self.calls.append(body)
        for chunk in self.chunks(body):
            yield time.perf_counter(), chunk


def test_text_only_requests_ask_for_text_alone_and_have_no_ttfa():
    client = _Client()
    record = asyncio.run(stream_one(client, "m", "hi", 3, text_only=True))
    assert client.calls[0]["modalities"] == ["text"] and "audio" not in client.calls[0]
    assert record.ok and record.ttfa_s is None and not record.no_speech
    assert (record.output_tokens, record.prompt_tokens) == (3, 13)
    # negative control: a default request asks for speech, and an answer without it is no_speech
    spoken = asyncio.run(stream_one(client, "m", "hi", 3))
    assert (
        client.calls[1]["modalities"] == ["text", "audio"] and client.calls[1]["audio"]["format"] == "pcm16"
    )
    assert spoken.no_speech
    row = summarize_level([record, record], wall_s=1.0)
    assert row["ttfa_ms_p50"] is None and row["no_speech"] == 0 and row["ttft_ms_p50"] is not None


def test_each_request_of_a_level_gets_its_own_max_tokens():
    client = _Client()

    async def send(client, model, prompt, max_tokens) -> RequestRecord:
        return await stream_one(client, model, prompt, max_tokens, text_only=True)

    records, _ = asyncio.run(
        run_level(client, "m", 2, 4, [2, 5, 3, 6], prompts=["a", "b", "c", "d"], send=send)
    )
    assert [r.output_tokens for r in records] == [2, 5, 3, 6]
    assert sorted(c["max_tokens"] for c in client.calls) == [2, 3, 5, 6]


# --- --text-only: its refusals and its default configs --------------------------------------------


@pytest.mark.parametrize("flags", [("--slo-ttfa-ms", "500"), ("--realtime",)], ids=lambda f: f[0])
def test_text_only_refuses_what_needs_audio(flags):
    with pytest.raises(SystemExit, match=f"--text-only requests have no audio, so {flags[0]}"):
        _checked_args(_args("--text-only", *flags))
    _checked_args(_args("--text-only", "--slo-ttft-ms", "500"))  # a TTFT SLO is fine
    _checked_args(_args("--text-only", "--multi-turn", "2"))  # multi-turn reads the TTFT too


def test_text_only_multi_turn_asks_for_text_alone(monkeypatch):
    """--multi-turn --text-only sends every turn with modalities ["text"] (the server answers
    without speech, and a vLLM thinker with its prefix cache on serves such a turn from it)."""
    from omni_pd.bench import load
    from omni_pd.bench.multi_turn import run_conversations
    from omni_pd.bench.serve_target import _sender

    sent = []

    async def fake(client, model, messages, max_tokens, text_only=False):
        sent.append(text_only)
        return RequestRecord(ok=True, text="ok", ttft_s=0.01, e2e_s=0.02)

    monkeypatch.setattr(load, "stream_one", fake)
    for flags, want in (((), False), (("--text-only",), True)):  # spoken turns: the control
        sent.clear()
        asyncio.run(run_conversations(None, "m", 2, 1, 4, send=_sender(_args(*flags))))
        assert sent == [want, want]


def test_text_only_defaults_to_the_thinker_only_configs(tmp_path):
    targets, _, _ = _targets(_args("--text-only"), tmp_path)
    assert [label for label, _ in targets] == ["qwen3_omni_tiny_thinker", "qwen3_omni_tiny_thinker_pd"]
    spoken, _, _ = _targets(_args(), tmp_path)  # negative control: the whole pipeline
    assert [label for label, _ in spoken] == ["qwen3_omni_tiny", "qwen3_omni_tiny_pd"]
    xpyd, baselines, _ = _targets(_args("--text-only", "--xpyd", "1P1D", "--xpyd-cpus", "0-1"), tmp_path)
    assert baselines == {"1P1D": "colocated-2x"}
    for label, path in xpyd:
        stages = load_pipeline_config(path).stages
        assert {s.model_stage for s in stages} == {"thinker"}, label
        assert len(stages) == (2 if label == "1P1D" else 1), label


def test_the_thinker_only_configs_hold_the_thinker_alone():
    colocated, pd = (load_pipeline_config(path) for path in TEXT_ONLY_CONFIGS)
    assert [s.model_stage for s in colocated.stages] == ["thinker"]
    assert [(s.is_prefill_only, s.is_decode_only) for s in pd.stages] == [(True, False), (False, True)]
    assert {s.model_stage for s in pd.stages} == {"thinker"}  # each loads only thinker.* (lean)
    for config in (colocated, pd):
        assert [s.final_output_type for s in config.final_output_stages()] == ["text"]


def test_the_first_token_is_timed_at_its_chunk_even_when_its_text_is_held_back():
    """The server sends a chunk per step with tokens, content "" while the detokenizer holds
    the text back (vLLM's client counts those): the first one is the TTFT, each one a token
    event; the finish chunk's "" is none."""
    contents = ["", "", "ab", "c"]

    class Held(_Client):
        def chunks(self, body):
            chunks = [{"choices": [{"delta": {"content": text}, "finish_reason": None}]} for text in contents]
            return chunks + [{"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}]

    record = asyncio.run(stream_one(Held(), "m", "hi", 4, text_only=True))
    assert record.ok and record.text == "abc" and record.output_tokens == 4
    assert len(record.itl_s) == 3  # four token chunks, the finish chunk not among them
    assert record.ttft_s is not None and record.ttft_s < record.e2e_s
    contents[:] = ["ab", "c"]  # control: no held-back chunks, two token events
    assert len(asyncio.run(stream_one(Held(), "m", "hi", 2, text_only=True)).itl_s) == 1


def test_a_workload_a_replica_cannot_hold_is_refused_naming_the_stage_and_key(tmp_path):
    from omni_pd.bench.capacity import check_kv_capacity

    colocated, pd = TEXT_ONLY_CONFIGS  # the P/D legs hold 512 blocks of 16 tokens: 8192
    targets = [("colocated", colocated), ("pd", pd), ("remote", None)]
    check_kv_capacity(targets, workload_from_args(_args("--prompt-tokens", "uniform:512:4096")))
    with pytest.raises(SystemExit) as refused:
        check_kv_capacity(
            targets, workload_from_args(_args("--prompt-tokens", "8000", "--output-tokens", "uniform:8:400"))
        )
    message = str(refused.value)
    assert message.startswith("error: pd: stage 1's KV pool holds 8192 tokens")  # the decode leg
    assert "engine_args.kv_pool_blocks 512" in message and "needs at least 8400" in message


@pytest.mark.parametrize("flag", ["--slo-ttft-ms", "--slo-ttfa-ms", "--slo-itl-ms"])
@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_an_slo_of_zero_or_less_is_refused_by_name(flag, value):
    with pytest.raises(SystemExit, match=f"error: {flag} must be a number of milliseconds above 0"):
        _checked_args(_args(flag, value))
    _checked_args(_args(flag, "250"))  # the control
