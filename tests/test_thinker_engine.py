"""The continuously batched thinker: a request decodes to the same bits alone or in any batch,
the scheduler honours max_num_seqs / max_num_batched_tokens / the KV cache, aborts free
everything, and the batched decoder computes transformers' thinker."""

import pytest
import torch

torch.set_num_threads(1)  # as in a stage worker on this machine; two threads on two busy cores crawl

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.attention import SequenceSlot, StepAttention
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.engines.core.paged_cache import PagedKVCache
from omni_pd.models.qwen3_omni.hf.build import thinker_model
from omni_pd.models.qwen3_omni.hf.thinker_forward import ThinkerForward, DecodeRow
from omni_pd.engines.core.build import ar_engine
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner, cache_to_canonical, thinker_layout
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.sampling import SamplingParams

from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.exactness

TINY_CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"

TEXTS = [
    "hi",
    "tell me about the sea",
    "x" * 50,
    "what is two plus two?",
    "a",
    "bonjour",
    "sing",
    "count to ten",
]


def _stage(**engine_args):
    stage = load_pipeline_config(TINY_CONFIG).stage(0)
    args = stage.engine_args.model_copy(update=engine_args)
    return stage.model_copy(update={"engine_args": args})


@pytest.fixture(scope="module")
def runner(tiny_model, tiny_tokenizer):
    return thinker_model(tiny_model, tiny_tokenizer)


def _engine(runner, **engine_args):
    stage = _stage(**engine_args)
    return ar_engine(stage, ThinkerRunner(runner, stage.engine_args.attention_kernels))


def _prompts(tokenizer):
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in TEXTS
    ]


def _params(count, max_tokens=16):
    # Greedy and seeded sampling, alternating, with different lengths.
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens - i % 3)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=100 + i)
        for i in range(count)
    ]


def _run_together(engine, prompts, params, stagger=0):
    """Add the requests (`stagger` steps apart), step until done; outputs and streamed deltas."""
    outputs, deltas, pending = {}, {}, list(range(len(prompts)))
    while pending or engine.has_unfinished_requests():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                i = pending.pop(0)
                engine.add_request(f"r{i}", prompts[i], params[i], stream=True)
        for _ in range(max(stagger, 1)):
            for out in engine.step() if engine.has_unfinished_requests() else []:
                assert out.error is None, out.error
                deltas.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    outputs[out.request_id] = out.output
    return [outputs[f"r{i}"] for i in range(len(prompts))], [
        deltas.get(f"r{i}", []) for i in range(len(prompts))
    ]


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_batched_requests_equal_their_solo_runs(runner, tiny_tokenizer, kernels):
    prompts, params = _prompts(tiny_tokenizer), _params(len(TEXTS))
    engine = _engine(runner, attention_kernels=kernels)
    solo = [engine.generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
    together, deltas = _run_together(engine, prompts, params)
    assert engine.batch_stats()["max_decode_batch"] == len(prompts)
    staggered, _ = _run_together(
        _engine(runner, max_num_seqs=3, attention_kernels=kernels), prompts, params, stagger=2
    )
    for i in range(len(prompts)):
        assert _same(solo[i], together[i]) and _same(solo[i], staggered[i]), TEXTS[i]
        assert deltas[i] == together[i].token_ids  # streamed deltas add up to the output
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_negative_control_without_tiles_batching_changes_the_bits(runner, tiny_tokenizer):
    prompts, params = _prompts(tiny_tokenizer), _params(len(TEXTS))
    engine = _engine(runner)
    with bi.disabled():
        solo = [engine.generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
        together, _ = _run_together(engine, prompts, params)
    assert not all(_same(a, b) for a, b in zip(solo, together))


def test_scheduler_honours_max_num_seqs_and_token_budget(runner, tiny_tokenizer):
    prompts, params = _prompts(tiny_tokenizer), _params(len(TEXTS))
    engine = _engine(runner, max_num_seqs=3)
    _run_together(engine, prompts, params)
    assert engine.batch_stats()["max_decode_batch"] == 3
    # Without chunked prefill, a budget as large as the longest short prompt fits one of them per
    # step, never two (tests/test_chunked_prefill.py: with it).
    small = [p for p in prompts if len(p.prompt_token_ids) <= 16]
    lengths = sorted(len(p.prompt_token_ids) for p in small)
    assert len(small) >= 3 and lengths[0] + lengths[1] > lengths[-1]
    engine = _engine(runner, max_num_batched_tokens=lengths[-1], enable_chunked_prefill=False)
    _run_together(engine, small, _params(len(small)))
    assert engine.batch_stats()["max_admitted"] == 1
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request("long", prompts[2], params[0])
    with pytest.raises(ValueError, match="kv_pool_blocks"):
        _engine(runner, kv_pool_blocks=1).add_request("big", prompts[0], params[0])
    assert engine.debug_state_counts()["thinker.requests"] == 0


def test_a_pool_too_small_for_the_batch_preempts_and_outputs_stay_exact(runner, tiny_tokenizer):
    """Blocks come as positions need them: requests start together, the pool runs out, the
    newest is preempted and computed again; every output (and what was streamed) is its solo
    run's. tests/test_preemption.py has the negative control."""
    prompts = [p for i, p in enumerate(_prompts(tiny_tokenizer)) if i in (0, 1, 3, 4)]
    params = _params(4)
    engine = _engine(runner, kv_pool_blocks=3)  # 2-3 blocks a request: room for one at a time
    solo = [_engine(runner).generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
    together, deltas = _run_together(engine, prompts, params)
    assert engine.batch_stats()["max_decode_batch"] >= 2  # nothing was reserved for max_tokens
    assert engine.load()["preemptions"] > 0
    assert all(_same(a, b) for a, b in zip(solo, together))
    assert deltas == [o.token_ids for o in together]  # nothing sent twice
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_abort_frees_the_request_and_the_others_finish_unchanged(runner, tiny_tokenizer):
    prompts, params = _prompts(tiny_tokenizer)[:3], _params(3, max_tokens=20)
    solo = [_engine(runner).generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
    engine = _engine(runner)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i])
    engine.step()
    engine.step()
    engine.abort_request("r1")
    engine.abort_request("never-added")
    assert engine.request_ids() == ["r0", "r2"]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.output for o in engine.step() if o.finished})
    assert set(outputs) == {"r0", "r2"}
    assert _same(outputs["r0"], solo[0]) and _same(outputs["r2"], solo[2])
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def _decode_step(cache, blocks, position, kernels="native"):
    """The engine's attention for one sequence decoding at `position` over `blocks`."""
    return StepAttention.for_decode(HfCompute(kernels), cache, [SequenceSlot(blocks, position, 1)])


def _prefill(decoder, prompts, inputs=None):
    """The decoder's batched prefill from position 0, each result with the KV its pass kept (as
    the engine's `compute_prefill` takes it)."""
    attention = StepAttention.for_prefill(HfCompute(), None, [SequenceSlot([], 0, len(p)) for p in prompts])
    results = decoder.prefill(prompts, attention, inputs=inputs)
    for index, result in enumerate(results):
        result.kv = attention.prompt_kv(index)
    return results


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_batched_decoder_computes_transformers_thinker(runner, tiny_model, tiny_tokenizer, kernels):
    """Teacher-forced: each step's logits and hidden states match transformers' own forward on
    the same cache (not bit for bit: other kernels)."""
    prompt = _prompts(tiny_tokenizer)[1]
    params = SamplingParams(temperature=0, max_tokens=8)
    pre = runner.prefill(prompt, params)
    cache = PagedKVCache(thinker_layout(runner.thinker, 16), 8)
    n = len(prompt.prompt_token_ids)
    blocks = cache.allocate(n + 8)
    cache.write(blocks, 0, cache_to_canonical(pre.cache))
    decoder = ThinkerForward(tiny_model.thinker, runner.accept_hidden_layer, kernels)
    token = pre.first_token
    for step in range(6):
        ours = decoder.step([DecodeRow(token, n + step, 0)], _decode_step(cache, blocks, n + step, kernels))
        theirs = tiny_model.thinker(
            input_ids=torch.tensor([[token]]),
            attention_mask=torch.ones((1, n + step + 1), dtype=torch.long),
            position_ids=runner._positions(n + step, 1, 0),
            past_key_values=pre.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        assert torch.allclose(ours.logits[0], theirs.logits[0, -1], atol=1e-5, rtol=1e-4)
        assert torch.equal(ours.embeds[0], theirs.hidden_states[0][0, -1])
        assert torch.allclose(
            ours.hidden[0], theirs.hidden_states[runner.accept_hidden_layer][0, -1], atol=1e-5, rtol=1e-4
        )
        token = int(theirs.logits[0, -1].argmax())
    # The KV our decoder wrote equals what transformers cached (to float tolerance).
    assert torch.allclose(cache.read(blocks, n + 6), cache_to_canonical(pre.cache), atol=1e-5)
    # Negative control: a perturbed cached key moves the logits past that tolerance.
    cache.data[blocks[0], 0, 0, 0, 0, 0] += 1.0
    moved = decoder.step([DecodeRow(token, n + 6, 0)], _decode_step(cache, blocks, n + 6, kernels)).logits[0]
    cache.data[blocks[0], 0, 0, 0, 0, 0] -= 1.0
    same = decoder.step([DecodeRow(token, n + 6, 0)], _decode_step(cache, blocks, n + 6, kernels)).logits[0]
    assert not torch.allclose(moved, same, atol=1e-5, rtol=1e-4)


def test_batched_prefill_computes_transformers_prefill(runner, tiny_model, tiny_tokenizer):
    """Text prompts prefilled in one pass: each prompt's KV, layer-0 rows, accept-layer rows and
    last logits are transformers' own prefill's (not bit for bit: other kernels), and a text
    prompt has no multimodal rotary offset (the pass uses none)."""
    prompts = _prompts(tiny_tokenizer)[:4]
    decoder = ThinkerForward(tiny_model.thinker, runner.accept_hidden_layer)
    params = SamplingParams(temperature=0, max_tokens=4)
    for prompt, ours in zip(prompts, _prefill(decoder, [p.prompt_token_ids for p in prompts])):
        theirs = runner.prefill(prompt, params)
        assert theirs.rope_deltas == 0
        assert torch.allclose(ours.kv, cache_to_canonical(theirs.cache), atol=1e-5)
        assert torch.equal(ours.rows["embeds"], theirs.prompt_embeds)
        assert torch.allclose(ours.rows["hidden"], theirs.prompt_hidden, atol=1e-5, rtol=1e-4)
        assert int(ours.logits.argmax()) == theirs.first_token


def test_a_prompt_prefills_to_the_same_bits_alone_and_with_others(runner, tiny_model, tiny_tokenizer):
    prompts = [p.prompt_token_ids for p in _prompts(tiny_tokenizer)]
    decoder = ThinkerForward(tiny_model.thinker, runner.accept_hidden_layer)
    alone = [_prefill(decoder, [p])[0] for p in prompts]

    def same(a, b):
        return (
            torch.equal(a.kv, b.kv)
            and torch.equal(a.logits, b.logits)
            and torch.equal(a.rows["embeds"], b.rows["embeds"])
            and torch.equal(a.rows["hidden"], b.rows["hidden"])
        )

    for order in (prompts, prompts[::-1], prompts[2:5]):
        together = _prefill(decoder, order)
        for p, result in zip(order, together):
            assert same(result, alone[prompts.index(p)])
    # Negative control: plain F.linear over the pass's rows changes some prompt's bits.
    with bi.disabled():
        plain_alone = [_prefill(decoder, [p])[0] for p in prompts]
        plain_together = _prefill(decoder, prompts)
    assert not all(same(a, b) for a, b in zip(plain_alone, plain_together))


def test_audio_prompts_prefill_in_the_batched_pass_as_transformers_does(runner, tiny_model, tiny_tokenizer):
    """A prompt with audio in the batched pass: its layer-0 rows are transformers' (the encoder's
    output merged at the placeholders, bit for bit), its KV, accept-layer rows and first token
    transformers' forward's (other kernels); and it prefills to the same bits alone and beside
    text prompts."""
    import numpy as np
    from omni_pd.models.qwen3_omni.prompt import OmniPrompt, PromptBuilder

    builder = PromptBuilder(tiny_tokenizer, tiny_model.config.thinker_config)
    sound = (0.3 * np.sin(np.arange(20_000) / 7.0)).astype(np.float32)
    prompt = builder.build(
        OmniPrompt(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "what is this?"}, {"type": "audio", "audio": sound}],
                }
            ]
        )
    )
    clips = runner.audio_clips(prompt)
    rows = runner.layer0_rows(prompt, clips, 0)
    decoder = ThinkerForward(tiny_model.thinker, runner.accept_hidden_layer)
    [ours] = _prefill(decoder, [prompt.prompt_token_ids], inputs=[rows])
    theirs = runner.prefill(prompt, SamplingParams(temperature=0, max_tokens=4))
    assert theirs.rope_deltas == 0  # audio keeps text positions: the pass's rotary is right
    assert torch.equal(ours.rows["embeds"], theirs.prompt_embeds)
    assert torch.allclose(ours.kv, cache_to_canonical(theirs.cache), atol=1e-5)
    assert torch.allclose(ours.rows["hidden"], theirs.prompt_hidden, atol=1e-5, rtol=1e-4)
    assert int(ours.logits.argmax()) == theirs.first_token
    # Negative control: the table's rows at the placeholders (no audio) give other KV.
    [blind] = _prefill(decoder, [prompt.prompt_token_ids])
    assert not torch.allclose(blind.kv, ours.kv, atol=1e-3)
    texts = [p.prompt_token_ids for p in _prompts(tiny_tokenizer)[:3]]
    together = _prefill(
        decoder, [texts[0], prompt.prompt_token_ids, *texts[1:]], inputs=[None, rows, None, None]
    )
    assert torch.equal(together[1].kv, ours.kv) and torch.equal(together[1].logits, ours.logits)
    assert torch.equal(together[1].rows["hidden"], ours.rows["hidden"])
