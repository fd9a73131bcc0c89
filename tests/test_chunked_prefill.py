"""Chunked prefill in the engine core: a prompt longer than what a step has left is computed over
several steps beside the running decodes, and chunked = whole, bit for bit: tokens, the rows the
talker reads, the KV in the blocks; over a cached prefix; on the P/D prefill leg (the published
KV's checksums and the decode side's output); for the text model too. The negative control: with
plain (batch-dependent) linear layers, a chunk's rows come out of other kernels and the same
comparisons see it."""

from __future__ import annotations

import pytest
import torch

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.ar_engine import ArEngine
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.core.pd_legs import DecodeEngine, PrefillEngine
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.models.qwen3_omni.hf.build import thinker_model
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.planning.pd import build_decode_sampling_params, build_prefill_sampling_params
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness  # scripts/test.sh runs these again under an older CPU level

COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
LONG = [
    "tell me a long story about the sea, the ships on it and the people who sail them " * 2,
    "what is two plus two, and why is it four and not five or three? explain it slowly",
    "bonjour, comment allez-vous aujourd'hui? il fait beau et le soleil brille sur la mer",
]
BUDGET = 16  # tokens a step: every prompt above is several chunks


def _stage(path, stage_id, **engine_args):
    stage = load_pipeline_config(path).stage(stage_id)
    return stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})


@pytest.fixture(scope="module")
def runner(tiny_model, tiny_tokenizer):
    return thinker_model(tiny_model, tiny_tokenizer)


def _thinker(runner, **engine_args) -> ArEngine:
    stage = _stage(COLOCATED, 0, **engine_args)
    return ar_engine(stage, ThinkerRunner(runner, stage.engine_args.attention_kernels))


def _prompts(tokenizer, texts=LONG):
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]


def _params(count, max_tokens=12):
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=7 + i)
        for i in range(count)
    ]


def _run(engine, prompts, params, stagger=0):
    """Requests added `stagger` steps apart; each one's output, its prompt KV as it lay in its
    blocks at its first token, and its streamed tokens."""
    outputs, kv, deltas, pending = {}, {}, {}, list(range(len(prompts)))
    while pending or engine.has_unfinished_requests():
        if pending:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i], stream=True)
            if not stagger:
                continue
        for _ in range(max(stagger, 1)):
            for out in engine.step() if engine.has_unfinished_requests() else []:
                assert out.error is None, out.error
                deltas.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    outputs[out.request_id] = out.output
            for rid in engine.scheduler.running:
                request = engine.scheduler.requests[rid]
                if rid not in kv:
                    kv[rid] = engine.kv.cache.read(request.blocks, request.prompt_len).clone()
    ids = [f"r{i}" for i in range(len(prompts))]
    return [outputs[r] for r in ids], [kv.get(r) for r in ids], [deltas.get(r, []) for r in ids]


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.prompt_embeds, b.prompt_embeds)
        and torch.equal(a.prompt_hidden, b.prompt_hidden)
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


def test_chunked_equals_whole_beside_running_decodes(runner, tiny_tokenizer):
    prompts, params = _prompts(tiny_tokenizer), _params(len(LONG))
    assert all(len(p.prompt_token_ids) > 2 * BUDGET for p in prompts)
    whole_engine = _thinker(runner, enable_prefix_caching=False)
    whole, whole_kv, _ = _run(whole_engine, prompts, params)
    assert whole_engine.batch_stats()["partial_chunks"] == 0
    # Staggered: each prompt's chunks run beside the decodes of the ones before it.
    engine = _thinker(runner, max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    chunked, chunked_kv, deltas = _run(engine, prompts, params, stagger=3)
    stats = engine.batch_stats()
    assert stats["partial_chunks"] >= sum(len(p.prompt_token_ids) // BUDGET for p in prompts) - 1
    assert stats["max_step_tokens"] <= BUDGET  # decodes and chunks share the budget
    assert stats["max_decode_batch"] >= 2
    for i in range(len(prompts)):
        assert _same(whole[i], chunked[i]), LONG[i]
        assert torch.equal(whole_kv[i], chunked_kv[i])
        assert deltas[i] == chunked[i].token_ids
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_negative_control_plain_linear_layers_make_chunks_differ(runner, tiny_tokenizer):
    prompts, params = _prompts(tiny_tokenizer), _params(len(LONG))
    with bi.disabled():
        whole, whole_kv, _ = _run(_thinker(runner, enable_prefix_caching=False), prompts, params)
        chunked, chunked_kv, _ = _run(
            _thinker(runner, max_num_batched_tokens=BUDGET, enable_prefix_caching=False), prompts, params
        )
    assert not all(torch.equal(a, b) for a, b in zip(whole_kv, chunked_kv))
    assert not all(_same(a, b) for a, b in zip(whole, chunked))


def test_chunks_over_a_cached_prefix_equal_the_whole_prompt(runner, tiny_tokenizer):
    first, second = _prompts(tiny_tokenizer, [LONG[0], LONG[0] + " and then the storm came"])
    params = _params(2)
    whole, whole_kv, _ = _run(_thinker(runner, enable_prefix_caching=False), [second], params[1:])
    engine = _thinker(runner, max_num_batched_tokens=BUDGET)
    _run(engine, [first], params[:1])
    got, got_kv, _ = _run(engine, [second], params[1:])
    assert got[0].metrics["prefix_cached_tokens"] >= 2 * BUDGET  # it started from cached blocks
    assert _same(whole[0], got[0]) and torch.equal(whole_kv[0], got_kv[0])


def test_the_text_model_prefills_in_chunks_too(tiny_tokenizer):
    from omni_pd.models.qwen3_text.hf.build import build_hf_engine  # noqa: PLC0415
    from omni_pd.models.qwen3_text.tiny_config import ensure_tiny_text_model  # noqa: PLC0415

    config = STAGE_CONFIGS_DIR / "ci" / "qwen3_text_hf.yaml"
    model = str(ensure_tiny_text_model())
    prompts = [p.prompt_token_ids for p in _prompts(tiny_tokenizer)]
    params = _params(len(prompts))

    def run(**engine_args):
        stage = _stage(config, 0, enable_prefix_caching=False, **engine_args)
        engine = build_hf_engine(stage, model)
        outputs, _, _ = _run(engine, [ThinkerPrompt(ids) for ids in prompts], params)
        return engine, outputs

    whole_engine, whole = run()
    engine, chunked = run(max_num_batched_tokens=BUDGET)
    assert engine.batch_stats()["partial_chunks"] > 0 and whole_engine.batch_stats()["partial_chunks"] == 0
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked]


@pytest.mark.slow
def test_the_prefill_leg_publishes_the_same_kv_in_chunks(runner, tiny_tokenizer):
    """P/D: a chunked prefill leg publishes the same blocks (their checksums) and the decode
    leg's output equals the colocated one's."""
    prompts, params = _prompts(tiny_tokenizer), _params(len(LONG))
    colocated, _, _ = _run(_thinker(runner, enable_prefix_caching=False), prompts, params)
    published_sums = {}
    for budget in (None, BUDGET):
        extra = {"max_num_batched_tokens": budget} if budget else {}
        prefill = PrefillEngine(_stage(PD, 0, enable_prefix_caching=False, **extra), ThinkerRunner(runner))
        decode = DecodeEngine(_stage(PD, 1), ThinkerRunner(runner))
        try:
            sums = []
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                published = prefill.generate(f"p{i}", prompt, build_prefill_sampling_params(p, f"x{i}"))
                sums.append(published.kv_transfer_params.get("block_checksums"))
                out = decode.generate(
                    f"d{i}", prompt, build_decode_sampling_params(p, published.kv_transfer_params, f"x{i}")
                )
                assert out.token_ids == colocated[i].token_ids
                assert torch.equal(out.output_hidden, colocated[i].output_hidden)
            assert all(sums) and (prefill.batch_stats()["partial_chunks"] > 0) == bool(budget)
            published_sums[budget] = sums
        finally:
            prefill.close()
            decode.close()
    assert published_sums[None] == published_sums[BUDGET]
