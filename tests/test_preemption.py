"""Preemption when KV blocks run out (the exact-output tests on the thinker and the talker are in
test_thinker_engine.py and test_talker_batch.py): the oldest request is never preempted; the
negative controls (a runner that forgets nothing on restart, a recomputed token that differs
from the one sent) are seen; on the P/D decode leg a preempted request whose KV came from the
prefill leg is computed again here and still equals colocated."""

from __future__ import annotations

import pytest
import torch

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.core.pd_legs import DecodeEngine, PrefillEngine
from omni_pd.models.qwen3_omni.hf.build import thinker_model
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.planning.pd import build_decode_sampling_params, build_prefill_sampling_params
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness  # scripts/test.sh runs these again under an older CPU level

COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
TEXTS = ["hi", "tell me about the sea", "bonjour", "count to ten"]
POOL = 3  # blocks: about one request's whole run


def _stage(path, stage_id, **engine_args):
    stage = load_pipeline_config(path).stage(stage_id)
    return stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})


@pytest.fixture(scope="module")
def runner(tiny_model, tiny_tokenizer):
    return thinker_model(tiny_model, tiny_tokenizer)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [
        ThinkerPrompt(
            tiny_tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in TEXTS
    ]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.8, max_tokens=16, seed=3),
] * 2


def _thinker(runner, **engine_args):
    return ar_engine(_stage(COLOCATED, 0, **engine_args), ThinkerRunner(runner))


@pytest.fixture(scope="module")
def solo(runner, prompts):
    return [_thinker(runner).generate(f"s{i}", p, PARAMS[i]) for i, p in enumerate(prompts)]


def _run(engine, requests, tamper=None):
    """Add `requests` ((id, prompt, params)) at once, step until done: outputs and errors.
    `tamper(engine)` runs after each step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, stream=True)
    outputs, errors = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.finished:
                outputs[out.request_id] = out.output
        if tamper is not None:
            tamper(engine)
    return outputs, errors


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


def test_the_oldest_is_never_preempted_and_outputs_stay_exact(runner, prompts, solo):
    engine = _thinker(runner, kv_pool_blocks=POOL)
    outputs, errors = _run(engine, [(f"r{i}", p, PARAMS[i]) for i, p in enumerate(prompts)])
    assert not errors and engine.load()["preemptions"] > 0
    assert "preemptions" not in outputs["r0"].metrics
    assert any(o.metrics.get("preemptions") for o in outputs.values())
    assert all(_same(outputs[f"r{i}"], solo[i]) for i in range(len(prompts)))
    assert engine.load()["running"] == engine.load()["waiting"] == 0


def test_negative_control_a_restart_that_forgets_nothing_changes_the_output(
    runner, prompts, solo, monkeypatch
):
    monkeypatch.setattr(ThinkerRunner, "restart", lambda self, request: None)
    engine = _thinker(runner, kv_pool_blocks=POOL)
    outputs, errors = _run(engine, [(f"r{i}", p, PARAMS[i]) for i, p in enumerate(prompts)])
    assert not errors and engine.load()["preemptions"] > 0
    assert not all(_same(outputs[f"r{i}"], solo[i]) for i in range(len(prompts)))


def test_a_recomputed_token_that_differs_from_the_one_sent_fails_its_request(runner, prompts):
    tampered: list[str] = []

    def tamper(engine):
        for rid in engine.scheduler.waiting:
            request = engine.scheduler.requests[rid]
            if request.replay and not tampered:
                request.replay = [request.replay[0] + 1, *request.replay[1:]]
                tampered.append(rid)

    engine = _thinker(runner, kv_pool_blocks=POOL)
    outputs, errors = _run(engine, [(f"r{i}", p, PARAMS[i]) for i, p in enumerate(prompts)], tamper)
    assert len(tampered) == 1 and set(errors) == set(tampered)
    assert "computed again after preemption" in errors[tampered[0]]
    assert set(outputs) == {f"r{i}" for i in range(len(prompts))} - set(tampered)
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_the_decode_leg_computes_a_preempted_remote_request_again(runner, prompts, solo):
    prefill = PrefillEngine(_stage(PD, 0), ThinkerRunner(runner))
    decode = DecodeEngine(_stage(PD, 1, kv_pool_blocks=POOL), ThinkerRunner(runner))
    try:
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
            published = prefill.generate(f"p{i}", prompt, build_prefill_sampling_params(params, f"x{i}"))
            requests.append(
                (f"r{i}", prompt, build_decode_sampling_params(params, published.kv_transfer_params, f"x{i}"))
            )
        outputs, errors = _run(decode, requests)
        assert not errors and decode.load()["preemptions"] > 0
        for i in range(len(prompts)):
            assert outputs[f"r{i}"].token_ids == solo[i].token_ids
            assert torch.equal(outputs[f"r{i}"].output_hidden, solo[i].output_hidden)
        assert decode.debug_state_counts()["thinker.requests"] == 0
        assert decode.debug_state_counts()["thinker.kv_blocks_in_use"] == 0
    finally:
        prefill.close()
        decode.close()
