"""VllmEngine's step loop, in-process on the CI's colocated vLLM config (run by
tests/test_vllm_engine_step.py in a fresh interpreter): requests added at once are stepped
together (vLLM batches them) and give the same tokens as each run alone.

Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`); see e2e/vllm_required.py for when it skips.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_required import TOKEN_PROMPTS, require_vllm

require_vllm()

import torch  # noqa: E402

from omni_pd import SamplingParams  # noqa: E402
from omni_pd.config import load_pipeline_config  # noqa: E402
from omni_pd.engines.types import TextOutput, TokenPrompt  # noqa: E402
from omni_pd.models.qwen3_omni.records import ThinkerPrompt  # noqa: E402
from omni_pd.models.qwen3_omni.tiny_config import TINY_MODEL_NAME  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "stage_configs/ci/qwen3_text_vllm.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, seed=0, ignore_eos=True)
PROMPTS = TOKEN_PROMPTS


@pytest.fixture(scope="module")
def engine():
    from omni_pd.engines.vllm.engine import build_vllm_engine

    (stage,) = load_pipeline_config(CONFIG).stages
    eng = build_vllm_engine(stage, TINY_MODEL_NAME)  # the YAML's engine_args.model wins
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt run alone, through the base class's generate() (add_request + step)."""
    out = {}
    for key, ids in PROMPTS.items():
        result = engine.generate(f"solo-{key}", TokenPrompt(list(ids)), GREEDY)
        assert isinstance(result, TextOutput)
        assert result.finish_reason == "length" and len(result.token_ids) == GREEDY.max_tokens
        assert result.prompt_token_ids == ids
        assert {"e2e_ms", "first_token_ms"} <= set(result.metrics)
        assert result.num_cached_prompt_tokens == 0 and result.kv_transfer_params is None
        out[key] = result.token_ids
    assert len({tuple(t) for t in out.values()}) == len(PROMPTS)  # prompt-dependent outputs
    assert_idle(engine)
    return out


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.request_ids() == []
    counts = engine.debug_state_counts()
    assert "vllm.engine_requests" in counts
    assert all(v == 0 for v in counts.values()), counts


def run(engine, max_steps: int = 500):
    """Step until idle: (final records by id, deltas by id, per-step sets of ids with tokens)."""
    finals, deltas, busy = {}, {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals, deltas, busy
        outputs = engine.step()
        busy.append({o.request_id for o in outputs if o.new_token_ids})
        for o in outputs:
            assert o.request_id not in finals, f"output for {o.request_id} after its final record"
            deltas.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.request_ids()}")


def test_batched_equals_solo_and_streams(engine, solo):
    for key, ids in PROMPTS.items():
        engine.add_request(f"batch-{key}", TokenPrompt(list(ids)), GREEDY, stream=True)
    assert sorted(engine.request_ids()) == sorted(f"batch-{k}" for k in PROMPTS)
    assert engine.debug_state_counts()["vllm.engine_requests"] == len(PROMPTS)
    finals, deltas, busy = run(engine)
    # Batching: some single step() produced tokens for several requests.
    assert max(len(ids) for ids in busy) >= 2, busy
    assert len(busy) < sum(len(t) for t in solo.values()), "one step per token: no batching"
    for key in PROMPTS:
        final = finals[f"batch-{key}"]
        assert final.finished and final.error is None, final
        assert final.output.token_ids == solo[key], key
        assert deltas[f"batch-{key}"] == final.output.token_ids  # deltas add up to the result
    assert_idle(engine)


def test_abort_one_others_finish(engine, solo):
    engine.abort_request("never-added")  # unknown ids are ignored
    for key, ids in PROMPTS.items():
        # The one to abort would outlive the others: vLLM must really drop it.
        params = dataclasses.replace(GREEDY, max_tokens=400) if key == "b" else GREEDY
        engine.add_request(f"abort-{key}", TokenPrompt(list(ids)), params, stream=True)
    seen_b = []
    for _ in range(3):
        seen_b += [o for o in engine.step() if o.request_id == "abort-b"]
    assert seen_b and not any(o.finished for o in seen_b)
    engine.abort_request("abort-b")
    engine.abort_request("abort-b")  # twice: now unknown, ignored
    assert "abort-b" not in engine.request_ids()
    counts = engine.debug_state_counts()
    assert counts["vllm.engine_requests"] == counts["vllm.unfinished_requests"] == 3, counts
    finals, _, _ = run(engine)
    assert "abort-b" not in finals  # no output follows an abort
    assert sorted(finals) == sorted(f"abort-{k}" for k in PROMPTS if k != "b")
    for rid, final in finals.items():
        assert final.error is None and final.output.token_ids == solo[rid.split("-")[1]]
    assert_idle(engine)


def test_refused_requests(engine):
    with pytest.raises(ValueError, match="token ids only"):
        engine.add_request("audio", ThinkerPrompt([1, 2, 3], input_features=torch.zeros(1, 4, 8)), GREEDY)
    engine.add_request("dup", TokenPrompt([5, 6, 7]), GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", TokenPrompt([5, 6, 7]), GREEDY)
    finals, _, _ = run(engine)
    assert list(finals) == ["dup"] and finals["dup"].error is None
    assert_idle(engine)


def test_deadline_aborts_in_vllm(engine):
    engine.add_request("late", TokenPrompt([9, 8, 7, 6]), dataclasses.replace(GREEDY, max_tokens=400))
    engine.add_request("on-time", TokenPrompt([9, 8, 7, 6]), GREEDY)
    engine._requests["late"].deadline = 0.0  # expired
    finals, _, _ = run(engine)
    assert finals["late"].error is not None and "TimeoutError" in finals["late"].error
    assert "took over" in finals["late"].error
    assert finals["on-time"].error is None
    assert_idle(engine)  # vLLM forgot the expired request too


def test_only_stop_strings_make_vllm_detokenize(engine):
    """Issue 48, item 5: the orchestrator streams its own text deltas, so vLLM detokenizes only a
    request with stop strings (it searches its text for them); any other request's text is its
    tokens decoded once at the end, as the hf engine decodes them. The control: a stop string
    that never occurs turns vLLM's detokenizer on, and its text is the same but for a trailing
    half character, which vLLM drops and the hf engine keeps as U+FFFD. A stop string from the
    middle of the answer still ends it there."""
    from omni_pd.engines.vllm.engine import to_vllm_sampling_params

    assert to_vllm_sampling_params(GREEDY).detokenize is False
    never_stops = dataclasses.replace(GREEDY, stop=("\x00never\x00",))
    assert to_vllm_sampling_params(never_stops).detokenize is True
    ids = TokenPrompt(list(PROMPTS["a"]))
    plain = engine.generate("detok-plain", ids, GREEDY)
    assert len(plain.text) >= 4, plain.text
    assert plain.text == engine.engine.get_tokenizer().decode(plain.token_ids, skip_special_tokens=True)
    by_vllm = engine.generate("detok-vllm", ids, never_stops)
    assert by_vllm.token_ids == plain.token_ids and by_vllm.text == plain.text.rstrip("\ufffd")
    middle = len(plain.text) // 2
    cut = plain.text[middle : middle + 2]
    stopped = engine.generate("detok-stop", ids, dataclasses.replace(GREEDY, stop=(cut,)))
    assert stopped.finish_reason == "stop" and cut not in stopped.text
    assert plain.text.startswith(stopped.text) and len(stopped.text) <= middle
    assert_idle(engine)
