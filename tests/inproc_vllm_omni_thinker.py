"""vLLM's Qwen3-Omni thinker (omni-pd's recording subclass, on the generic vLLM engine) against
transformers' thinker on the same tiny weights (run by tests/test_vllm_engine_step.py in a fresh
interpreter). What the talker reads must agree: the layer-0 embeddings and the accept-layer
hidden states, for the prompt and every generated token fed back; and the logits of each step.
Greedy tokens are compared where the logits leave room for it (the top two apart by more than
the tolerance); where they tie, the test reports it instead of hiding it.

Tolerances (float32, CPU): vLLM's kernels (its attention, fused MoE, RMSNorm) are not
transformers', so the rows agree to rounding, not to the bit. Measured here: layer 0 exact (with
audio too: vLLM's audio tower on the prompt builder's features), accept layer ~2e-8, log-
probabilities ~5e-7.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from omni_pd import SamplingParams, registry  # noqa: E402
from omni_pd.config import load_pipeline_config  # noqa: E402
from omni_pd.models.qwen3_omni.factory import load_model  # noqa: E402
from omni_pd.models.qwen3_omni.records import ThinkerChunk, ThinkerOutput, ThinkerPrompt  # noqa: E402
from omni_pd.models.qwen3_omni.tiny_config import ACCEPT_HIDDEN_LAYER, TINY_MODEL_NAME  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "stage_configs/ci/qwen3_omni_tiny_vllm.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, seed=0, ignore_eos=True)
ROW_TOL = {"embeds": 1e-6, "hidden": 1e-5}
LOGPROB_TOL = 1e-4
TEXTS = ["Hi", "Please describe how tides are made by the moon.", "x" * 40]


@pytest.fixture(scope="module")
def stage():
    """The CI file's thinker with vLLM's prefix cache on: a request that records rows computes
    its prompt whole regardless (the tests below check both kinds of request)."""
    stage = load_pipeline_config(CONFIG).stage(0)
    args = stage.engine_args.model_copy(update={"enable_prefix_caching": True})
    return stage.model_copy(update={"engine_args": args})


@pytest.fixture(scope="module")
def engine(stage):
    from omni_pd.engines.vllm.engine import build_vllm_engine

    eng = build_vllm_engine(stage, TINY_MODEL_NAME, registry.vllm_hooks(TINY_MODEL_NAME))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(stage):
    """transformers' thinker with the hf stages' weights (`load_format: dummy`, the same seed)."""
    model = load_model(TINY_MODEL_NAME, load_format="dummy", seed=stage.engine_args.seed)
    return model.thinker


@pytest.fixture(scope="module")
def prompts():
    pipeline = registry.load_pipeline(TINY_MODEL_NAME)
    return [pipeline.build_prompt(pipeline.normalize_prompt(t)) for t in TEXTS]


def run(engine, max_steps: int = 500):
    finals, chunks = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals, chunks
        for out in engine.step():
            assert out.error is None, out.error
            if out.chunk is not None:
                chunks.setdefault(out.request_id, []).append(out.chunk)
            if out.finished:
                finals[out.request_id] = out.output
    raise AssertionError(f"engine still busy: {engine.request_ids()}")


@pytest.fixture(scope="module")
def batched(engine, prompts):
    """Every prompt at once (vLLM batches them), streamed with chunks as a talker would take them."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, stream=True, chunks=True)
    finals, chunks = run(engine)
    assert sorted(finals) == [f"r{i}" for i in range(len(prompts))]
    assert engine.debug_state_counts() == {k: 0 for k in engine.debug_state_counts()}
    return finals, chunks


@torch.no_grad()
def transformers_pass(thinker, ids: list[int]):
    """hidden_states and log-probabilities of one teacher-forced pass over `ids`."""
    out = thinker(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.hidden_states, torch.log_softmax(out.logits[0].float(), dim=-1)


def test_rows_agree_with_transformers(batched, reference):
    finals, _ = batched
    for rid, out in finals.items():
        assert isinstance(out, ThinkerOutput)
        prompt_len = len(out.prompt_token_ids)
        fed = out.prompt_token_ids + out.token_ids[:-1]  # the last token is never fed
        hidden, _ = transformers_pass(reference, fed)
        embeds = torch.cat([out.prompt_embeds, out.output_embeds])
        accept = torch.cat([out.prompt_hidden, out.output_hidden])
        assert out.output_start == prompt_len and embeds.shape[0] == len(fed)
        assert (embeds - hidden[0][0]).abs().max() <= ROW_TOL["embeds"], rid
        assert (accept - hidden[ACCEPT_HIDDEN_LAYER][0]).abs().max() <= ROW_TOL["hidden"], rid


def test_negative_control_a_neighbouring_layer_does_not_agree(batched, reference):
    out = batched[0]["r1"]
    hidden, _ = transformers_pass(reference, out.prompt_token_ids)
    for wrong in (ACCEPT_HIDDEN_LAYER - 1, ACCEPT_HIDDEN_LAYER + 1):
        assert (out.prompt_hidden - hidden[wrong][0]).abs().max() > 100 * ROW_TOL["hidden"]


def test_logits_agree_and_greedy_tokens_match_where_they_are_not_tied(engine, prompts, reference):
    import vllm

    params = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=GREEDY.max_tokens,
        ignore_eos=True,
        logprobs=20,
        skip_reading_prefix_cache=True,  # each prompt computed whole, as transformers computes it
    )
    for i, prompt in enumerate(prompts):
        engine.engine.add_request(f"lp{i}", {"prompt_token_ids": list(prompt.prompt_token_ids)}, params)
    done = {}
    while engine.engine.has_unfinished_requests():
        for out in engine.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    engine.engine.collective_rpc("omni_pd_take_rows")  # these requests bypassed the engine's books
    worst, ties = 0.0, []
    for i, prompt in enumerate(prompts):
        completion = done[f"lp{i}"]
        ids = list(prompt.prompt_token_ids)
        _, logprobs = transformers_pass(reference, ids + list(completion.token_ids))
        for step, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = logprobs[len(ids) + step - 1]
            for candidate, lp in top.items():
                worst = max(worst, abs(row[candidate].item() - lp.logprob))
            best2 = torch.topk(row, 2).values
            if (best2[0] - best2[1]).item() > LOGPROB_TOL:
                assert token == int(row.argmax()), (i, step)
            else:
                ties.append((i, step, (best2[0] - best2[1]).item()))
    print(f"vLLM vs transformers: max |log-prob difference| {worst:.2e}; near-ties {ties}")
    assert worst <= LOGPROB_TOL


def test_chunks_add_up_to_the_final_record(batched):
    finals, chunks = batched
    for rid, out in finals.items():
        pieces: list[ThinkerChunk] = chunks[rid]
        assert pieces[0].prompt_token_ids == out.prompt_token_ids
        assert torch.equal(pieces[0].prompt_embeds, out.prompt_embeds)
        assert torch.equal(pieces[0].prompt_hidden, out.prompt_hidden)
        assert [t for c in pieces for t in c.token_ids] == out.token_ids
        position = len(out.prompt_token_ids)
        for chunk in pieces:
            assert chunk.start == position
            position += chunk.embeds.shape[0]
        assert torch.equal(torch.cat([c.embeds for c in pieces]), out.output_embeds)
        # A talker alongside gets each fed-back row one step after its token.
        assert sum(c.embeds.shape[0] for c in pieces) == len(out.token_ids) - 1


def test_audio_prompts_take_the_prompt_builders_features(engine, reference):
    """Two audios of different lengths, through vLLM's multimodal input as the prompt builder's
    own features: the same rows as transformers, which merges the same features itself."""
    import numpy as np

    pipeline = registry.load_pipeline(TINY_MODEL_NAME)
    tones = [
        (0.2 * np.sin(np.arange(n) / 16000 * 2 * np.pi * hz)).astype(np.float32)
        for n, hz in ((24000, 330), (9000, 500))
    ]
    prompt = pipeline.build_prompt(
        pipeline.normalize_prompt(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What are these?"},
                        *({"type": "audio", "audio": t} for t in tones),
                    ],
                }
            ]
        )
    )
    assert prompt.input_features.shape[0] == 2
    out = engine.generate("audio", prompt, GREEDY)
    fed = out.prompt_token_ids + out.token_ids[:-1]
    with torch.no_grad():
        ref = reference(
            input_ids=torch.tensor([fed]),
            input_features=prompt.input_features,
            feature_attention_mask=prompt.feature_attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
    embeds = torch.cat([out.prompt_embeds, out.output_embeds])
    accept = torch.cat([out.prompt_hidden, out.output_hidden])
    assert embeds.shape[0] == len(fed)
    assert (embeds - ref.hidden_states[0][0]).abs().max() <= ROW_TOL["embeds"]
    assert (accept - ref.hidden_states[ACCEPT_HIDDEN_LAYER][0]).abs().max() <= ROW_TOL["hidden"]
    # The audio really went in: the same prompt's text rows without the audio features differ.
    silent = ThinkerPrompt(list(prompt.prompt_token_ids))
    plain = engine.generate("plain", silent, GREEDY)
    assert not torch.equal(plain.prompt_embeds, out.prompt_embeds)


def test_too_many_audios_are_refused_by_name(engine):
    many = ThinkerPrompt(
        [1, 2, 3],
        input_features=torch.zeros(5, 128, 8),
        feature_attention_mask=torch.ones(5, 8, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="5 audio inputs; the vLLM thinker takes at most 4"):
        engine.add_request("many", many, GREEDY)
    assert engine.request_ids() == []


LONG = "Tell me, slowly and in order, how the tides rise and fall along a long sandy coast. " * 3


def test_prefix_cache_serves_text_only_requests_and_rows_requests_compute_their_prompt(engine):
    """With vLLM's prefix cache on: a request that records rows (a talker reads them) computes
    its prompt whole, with the same rows as on an engine whose cache holds nothing; a text-only
    request (no rows) is served from the cached blocks."""
    pipeline = registry.load_pipeline(TINY_MODEL_NAME)
    prompt = pipeline.build_prompt(pipeline.normalize_prompt(LONG))
    blocks = len(prompt.prompt_token_ids) // engine.engine.vllm_config.cache_config.block_size
    assert blocks >= 2, "the prompt must fill whole blocks for the cache to hold them"
    before = engine.load()
    first = engine.generate("rows-1", prompt, GREEDY)  # nothing cached yet: computed whole
    assert first.metrics["prefix_cached_tokens"] == 0
    assert engine.load()["prefix_cache_queries"] == before["prefix_cache_queries"]  # it read none
    engine.add_request("text-only", prompt, GREEDY, rows=False)
    finals, _ = run(engine)
    text_only = finals["text-only"]
    assert text_only.metrics["prefix_cached_tokens"] >= 32  # served from the blocks rows-1 left
    assert text_only.prompt_embeds is None  # it asked for no rows
    # The replica's counters (/metrics' omni_pd_prefix_cache_{queries,hits}_total) count it.
    after = engine.load()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(prompt.prompt_token_ids)
    assert (
        after["prefix_cache_hits"] - before["prefix_cache_hits"] == text_only.metrics["prefix_cached_tokens"]
    )
    again = engine.generate("rows-2", prompt, GREEDY)
    assert again.metrics["prefix_cached_tokens"] == 0  # computed whole, though its blocks are cached
    assert again.token_ids == first.token_ids
    for name in ("prompt_embeds", "prompt_hidden", "output_embeds", "output_hidden"):
        assert torch.equal(getattr(again, name), getattr(first, name)), name
    print(
        f"prefix cache: text-only request served {text_only.metrics['prefix_cached_tokens']} of "
        f"{len(prompt.prompt_token_ids)} prompt tokens from the cache; its tokens "
        f"{'equal' if text_only.token_ids == first.token_ids else 'differ from'} the whole prompt's"
    )


def test_negative_control_a_rows_request_that_reads_the_cache_misses_its_prompt_rows(engine, monkeypatch):
    """Without the engine asking vLLM to compute the prompt whole, a cached prompt's positions
    record no rows, and the output names how many it has."""
    from omni_pd.engines.vllm import engine as vllm_engine

    pipeline = registry.load_pipeline(TINY_MODEL_NAME)
    prompt = pipeline.build_prompt(pipeline.normalize_prompt(LONG))
    engine.generate("warm", prompt, GREEDY)  # its blocks are cached (if not already)
    plain = vllm_engine.to_vllm_sampling_params
    monkeypatch.setattr(
        vllm_engine,
        "to_vllm_sampling_params",
        lambda params, rows=True, skip_cache=False: plain(params, rows),
    )
    with pytest.raises(RuntimeError, match=r"recorded \d+ of the prompt's \d+ rows"):
        engine.generate("reads-cache", prompt, GREEDY)
    monkeypatch.undo()
    assert engine.request_ids() == []
