"""The continuously batched talker engine: batch invariance (a request's codes are bit-identical
alone or among others, whatever the schedule), the negative controls that show the comparison can
fail, the model it computes against transformers' talker and code predictor (teacher-forced), and
abort / validation.

Why it holds: every linear / MoE runs through `batch_invariant` (fixed row tiles), attention runs
per sequence, prefills run alone, and sampling draws from per-request generators keyed by
(seed, step, code group).
"""

import pytest
import torch
from transformers import DynamicCache

from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.models.qwen3_omni.hf.talker_model import TalkerModel
from omni_pd.models.qwen3_omni.hf.talker_runner import TalkerRunner
from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.build import ar_engine
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.models.qwen3_omni.records import TalkerPrompt
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness

IM_END = 261
MESSAGES = [
    "Say hello.",
    "Hi",
    "Tell me a long story about a cat and a dog, please.",
    "What is two plus two?",
    "ok",
    "Describe the weather today in three short words.",
]
OUTPUT_LENGTHS = [6, 3, 9, 5, 12, 4]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=7, max_tokens=32),
    SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=40),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.05, seed=8, max_tokens=28),
    SamplingParams(temperature=0.7, seed=9, max_tokens=36),
    SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=10, max_tokens=30),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the tiny model gains nothing from more, and on a shared, busy CPU
    OpenMP threads spinning against each other make these tests orders of magnitude slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompt(model, tokenizer, index, perturb_at=None):
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": MESSAGES[index]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    count = OUTPUT_LENGTHS[index]
    generated = [40 + (7 * index + j) % 50 for j in range(count - 1)] + [IM_END]
    width = model.config.thinker_config.text_config.hidden_size
    rows = len(ids) + len(generated) - 1  # the last generated token is never fed back
    generator = torch.Generator().manual_seed(1000 + index)
    embeds = torch.randn(rows, width, generator=generator)
    hidden = torch.randn(rows, width, generator=generator)
    if perturb_at is not None:
        embeds[perturb_at] += 1e-4
    return TalkerPrompt(f"req-{index}", ids, generated, embeds, hidden)


@pytest.fixture(scope="module")
def prompts(tiny_model, tiny_tokenizer):
    return [_prompt(tiny_model, tiny_tokenizer, i) for i in range(len(MESSAGES))]


@pytest.fixture(scope="module", params=["native", "torch"])
def kernels(request):
    """Both attention paths: the C kernel (one call per layer for the whole batch) and torch's
    attention per sequence."""
    return request.param


@pytest.fixture(scope="module")
def alone(tiny_model, prompts, kernels):
    """Each request on a fresh engine of its own: codes and the raw logits of every step."""
    results = {}
    for prompt, params in zip(prompts, PARAMS):
        engine = _engine(tiny_model, kernels, max_num_seqs=8, max_num_batched_tokens=256)
        results.update(_run(engine, [[(prompt, params)]])[0])
    return results


def _engine(model, kernels="native", **engine_args):
    """The talker stage of the tiny colocated config, `engine_args` changed; each request's
    state records its raw logits, step by step."""
    stage = load_pipeline_config(STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml").stage(1)
    stage = stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})
    runner = TalkerModel(model.talker, model.thinker.get_input_embeddings(), model.config)
    return ar_engine(stage, TalkerRunner(model.talker, runner, trace=True, kernels=kernels))


CLEAN = {"talker.requests": 0, "talker.kv_blocks_in_use": 0}


def _run(engine, batches, steps_between=3):
    """Add each batch of (prompt, params), stepping `steps_between` times between batches, then
    run to completion. Returns {request_id: (codes, trace)} and the largest decode batch seen."""
    codes, states, widest = {}, {}, 0

    def step():
        nonlocal widest
        widest = max(widest, len(engine.scheduler.running))
        for out in engine.step():
            assert out.finished and out.error is None, out.error
            codes[out.request_id] = out.output.codes

    for index, batch in enumerate(batches):
        for prompt, params in batch:
            engine.add_request(prompt.request_id, prompt, params)
            states[prompt.request_id] = engine.scheduler.requests[prompt.request_id].model
        for _ in range(steps_between if index + 1 < len(batches) else 0):
            step()
    while engine.has_unfinished_requests():
        step()
    assert engine.debug_state_counts() == CLEAN
    return {rid: (c, states[rid].trace) for rid, c in codes.items()}, widest


def _same(a, b) -> bool:
    """Bitwise: the codes, and every logit the request computed (talker and code predictor)."""
    (codes_a, trace_a), (codes_b, trace_b) = a, b
    if not torch.equal(codes_a, codes_b):
        return False
    flat_a = trace_a["code0_logits"] + trace_a["hidden"] + [x for f in trace_a["cp_logits"] for x in f]
    flat_b = trace_b["code0_logits"] + trace_b["hidden"] + [x for f in trace_b["cp_logits"] for x in f]
    return len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def _assert_same(got, expected):
    assert set(got) == set(expected)
    for request_id in expected:
        assert _same(got[request_id], expected[request_id]), request_id


def test_alone_runs_produce_frames(alone, tiny_model):
    groups = tiny_model.config.talker_config.num_code_groups
    for codes, trace in alone.values():
        assert codes.dtype == torch.long and codes.shape[0] == groups and codes.shape[1] > 0
        assert len(trace["code0_logits"]) == codes.shape[1] + 1 == len(trace["cp_logits"]) + 1
    # Different requests really differ (the comparisons below are not vacuous), and both ends
    # occur: a codec EOS before max_tokens, and max_tokens reached.
    assert len({tuple(c.flatten().tolist()) for c, _ in alone.values()}) == len(alone)
    ends = {codes.shape[1] + 1 < params.max_tokens for (codes, _), params in zip(alone.values(), PARAMS)}
    assert ends == {True, False}


def test_batched_all_at_once_matches_alone(tiny_model, prompts, alone, kernels):
    engine = _engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024)
    got, widest = _run(engine, [list(zip(prompts, PARAMS))])
    assert widest == len(prompts)
    _assert_same(got, alone)


def test_staggered_and_limited_batches_match_alone(tiny_model, prompts, alone, kernels):
    pairs = list(zip(prompts, PARAMS))
    longest = max(len(p.prompt_token_ids) for p in prompts) + 9
    # Fewer seats than requests, and a token budget that admits about two prompts per step.
    engine = _engine(tiny_model, kernels, max_num_seqs=4, max_num_batched_tokens=2 * longest)
    got, widest = _run(engine, [pairs[:3], pairs[3:]], steps_between=4)
    assert widest == 4
    _assert_same(got, alone)
    # Reversed arrival order, one request added per step.
    engine = _engine(tiny_model, kernels, max_num_seqs=5, max_num_batched_tokens=1024)
    got, widest = _run(engine, [[pair] for pair in reversed(pairs)], steps_between=1)
    assert widest == 5
    _assert_same(got, alone)


def test_kv_block_size_does_not_change_results(tiny_model, prompts, alone, kernels):
    """The talker's KV lives in the engine's paged cache: blocks of one position each, or of 64,
    scattered among other requests' blocks, change nothing."""
    for block_size in (1, 64):
        engine = _engine(
            tiny_model,
            kernels,
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            kv_block_size=block_size,
            kv_pool_blocks=8192 // block_size,
        )
        got, _ = _run(engine, [list(zip(prompts, PARAMS))])
        _assert_same(got, alone)


def test_a_pool_too_small_for_the_batch_preempts_and_codes_stay_exact(tiny_model, prompts, alone, kernels):
    """Blocks come as positions need them, nothing reserved for max_tokens: with room for about
    one request's whole run, requests start together, the newest are preempted when the pool
    runs out and computed again, and each still gives its solo codes (and logits: the trace)."""
    probe = _engine(tiny_model, kernels)
    needs = [
        probe.kv.blocks_for(probe.runner.new_request(p.request_id, p, params).prompt_len + params.max_tokens)
        for p, params in zip(prompts, PARAMS)
    ]
    # The requests of which no two fit a pool as large as the largest of them.
    chosen = [i for i, n in enumerate(needs) if n < 2 * min(needs)]
    pool = max(needs[i] for i in chosen)
    assert len(chosen) >= 3 and all(needs[i] + needs[j] > pool for i in chosen for j in chosen)
    engine = _engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024, kv_pool_blocks=pool)
    got, widest = _run(engine, [[(prompts[i], PARAMS[i]) for i in chosen]])
    assert widest >= 2 and engine.load()["preemptions"] > 0
    _assert_same(got, {prompts[i].request_id: alone[prompts[i].request_id] for i in chosen})
    assert engine.load()["requests"] == 0 and engine.kv.num_free == pool
    with pytest.raises(ValueError, match="kv_pool_blocks"):
        _engine(tiny_model, kernels, kv_pool_blocks=1).add_request("big", prompts[0], PARAMS[0])


def test_a_perturbed_input_is_noticed(tiny_model, tiny_tokenizer, prompts, alone, kernels):
    """Negative control: the same comparison sees a 1e-4 change of one thinker embedding (it
    moves every logit of that request, bitwise; whether a code flips depends on the margins)."""
    assistant = max(
        i for i, t in enumerate(prompts[2].prompt_token_ids) if t == tiny_model.config.im_start_token_id
    )
    perturbed = _prompt(tiny_model, tiny_tokenizer, 2, perturb_at=assistant + 1)
    batch = list(zip(prompts, PARAMS))
    batch[2] = (perturbed, PARAMS[2])
    engine = _engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024)
    got, _ = _run(engine, [batch])
    assert not _same(got["req-2"], alone["req-2"])
    _assert_same(
        {k: v for k, v in got.items() if k != "req-2"}, {k: v for k, v in alone.items() if k != "req-2"}
    )


def test_plain_linear_would_break_invariance(tiny_model, prompts, alone, kernels, monkeypatch):
    """Negative control: with `F.linear` on the whole batch instead of fixed row tiles, a
    request's numbers depend on its batch (CPU GEMM takes other kernels for other row counts)."""
    rows = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    full = torch.nn.functional.linear(rows, weight)
    if all(torch.equal(torch.nn.functional.linear(rows[:n], weight), full[:n]) for n in range(1, 16)):
        pytest.skip("this CPU's GEMM happens to be row-count invariant for these shapes")
    monkeypatch.setattr(bi, "linear", lambda x, w, b=None: torch.nn.functional.linear(x, w, b))
    pairs = list(zip(prompts, PARAMS))
    got, _ = _run(_engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024), [pairs])
    solo = {}
    for pair in pairs:
        solo.update(
            _run(_engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024), [[pair]])[0]
        )
    assert not all(_same(got[rid], solo[rid]) for rid in solo)


def test_engine_computes_transformers_talker_teacher_forced(tiny_model, prompts, kernels):
    """Feed transformers' talker and code predictor the codes the engine produced, and compare
    the logits step by step (allclose: transformers runs other kernels, grouped_mm experts)."""
    talker = tiny_model.talker
    runner = TalkerModel(talker, tiny_model.thinker.get_input_embeddings(), tiny_model.config)
    prompt, params = prompts[0], SamplingParams(temperature=0, max_tokens=24)
    inputs = runner.build_inputs(prompt)
    # Decode together with another request, so the batched path is what gets checked.
    engine = _engine(tiny_model, kernels, max_num_seqs=4, max_num_batched_tokens=1024)
    engine.add_request(prompt.request_id, prompt, params)
    engine.add_request("other", prompts[1], params)
    request = engine.scheduler.requests[prompt.request_id]
    state = request.model
    while engine.has_unfinished_requests():
        engine.step()
    frames = state.frames
    assert len(frames) == len(request.tokens) - 1 >= 8
    close = dict(atol=1e-5, rtol=1e-4)

    cache = DynamicCache(config=talker.config.text_config)
    with torch.no_grad():
        out = talker(
            inputs_embeds=inputs["inputs_embeds"],
            attention_mask=inputs["attention_mask"],
            talker_input_ids=inputs["talker_input_ids"],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        for step, frame in enumerate(frames):
            assert torch.allclose(state.trace["code0_logits"][step], out.logits[0, -1], **close), step
            past_hidden = out.hidden_states[0][-1][:, -1:]  # what transformers' generate reads
            assert torch.allclose(state.trace["hidden"][step], past_hidden[0, 0], **close), step
            if step < 3:  # the code predictor for a few frames, group by group
                code0 = talker.get_input_embeddings()(torch.tensor([[frame[0]]]))
                embeds = torch.cat((past_hidden, code0), dim=1)
                cp_cache = DynamicCache(config=talker.code_predictor.config)
                cp_out = talker.code_predictor(inputs_embeds=embeds, past_key_values=cp_cache, use_cache=True)
                for group in range(1, len(frame)):
                    assert torch.allclose(
                        state.trace["cp_logits"][step][group - 1], cp_out.logits[0, -1], **close
                    ), (step, group)
                    if group + 1 < len(frame):
                        cp_out = talker.code_predictor(
                            input_ids=torch.tensor([[frame[group]]]),
                            past_key_values=cp_cache,
                            use_cache=True,
                            generation_steps=cp_out.generation_steps,
                        )
            # The next input as transformers' prepare_inputs_for_generation builds it.
            parts = [talker.get_input_embeddings()(torch.tensor([[frame[0]]]))]
            parts += [
                talker.code_predictor.get_input_embeddings()[g - 1](torch.tensor([[frame[g]]]))
                for g in range(1, len(frame))
            ]
            embed = torch.cat(parts, dim=1).sum(1, keepdim=True)
            trailing = inputs["trailing_text_hidden"]
            embed = embed + (
                trailing[:, step].unsqueeze(1) if step < trailing.shape[1] else inputs["tts_pad_embed"]
            )
            out = talker(
                inputs_embeds=embed,
                past_key_values=cache,
                use_cache=True,
                attention_mask=torch.ones((1, cache.get_seq_length() + 1), dtype=torch.long),
                generation_step=out.generation_step,
                output_hidden_states=True,
            )
        assert torch.allclose(state.trace["code0_logits"][len(frames)], out.logits[0, -1], **close)


def test_ignore_eos_runs_the_talker_to_max_tokens(tiny_model, prompts, alone, kernels):
    """A codec EOS has no frame, so ignore_eos keeps the talker from sampling it: the request
    runs to max_tokens. Without it (the alone runs) some of these requests stop early."""
    pairs = list(zip(prompts, PARAMS))
    early = [(p, params) for p, params in pairs if alone[p.request_id][0].shape[1] + 1 < params.max_tokens]
    assert early
    engine = _engine(tiny_model, kernels, max_num_seqs=16, max_num_batched_tokens=1024)
    got, _ = _run(engine, [[(p, params.replace(ignore_eos=True)) for p, params in early]])
    for prompt, params in early:
        codes, _ = got[prompt.request_id]
        assert codes.shape[1] == params.max_tokens - 1  # the last code0 is cut: no frame


def test_eos_and_max_tokens_frame_bookkeeping(tiny_model, prompts, alone):
    """A code0 cut by max_tokens, or the codec EOS, gets no frame (as in transformers)."""
    prompt, params = prompts[0], PARAMS[0]
    full = alone[prompt.request_id][0]
    assert full.shape[1] == params.max_tokens - 1  # no EOS drawn: the last code0 has no frame
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    engine.runner.codec_eos = int(full[0, 5])  # pretend the sixth frame's code0 is the EOS
    first = full[0].tolist().index(engine.runner.codec_eos)
    codes = engine.generate(prompt.request_id, prompt, params).codes
    assert torch.equal(codes, full[:, :first])
    short = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    codes = short.generate(prompt.request_id, prompt, params.replace(max_tokens=1)).codes
    assert codes.shape == (full.shape[0], 0)


def test_abort_drops_state_and_others_finish_unchanged(tiny_model, prompts, alone):
    engine = _engine(tiny_model, max_num_seqs=3, max_num_batched_tokens=1024)
    for prompt, params in zip(prompts, PARAMS):
        engine.add_request(prompt.request_id, prompt, params)
    assert engine.debug_state_counts() == {"talker.requests": len(prompts), "talker.kv_blocks_in_use": 0}
    outputs = {}

    def step():
        for out in engine.step():
            assert out.finished and out.error is None, out.error
            outputs[out.request_id] = out.output.codes

    for _ in range(3):
        step()
    running, waiting = list(engine.scheduler.running), list(engine.scheduler.waiting)
    assert len(running) == 3 and waiting
    aborted = {running[1], waiting[-1]}  # one mid-decode, one never admitted
    for request_id in aborted:
        engine.abort_request(request_id)
    engine.abort_request("no-such-request")
    assert engine.debug_state_counts() == {
        "talker.requests": len(prompts) - len(outputs) - 2,
        "talker.kv_blocks_in_use": engine.debug_state_counts()["talker.kv_blocks_in_use"],
    }
    assert not aborted & set(engine.request_ids())
    while engine.has_unfinished_requests():
        step()
    assert engine.debug_state_counts() == CLEAN
    assert engine.request_ids() == [] and not engine.scheduler.running and not engine.scheduler.waiting
    assert set(outputs) == set(alone) - aborted
    for request_id, codes in outputs.items():
        assert torch.equal(codes, alone[request_id][0]), request_id


def test_a_prompt_failing_in_a_shared_prefill_fails_alone(tiny_model, prompts, alone, kernels, monkeypatch):
    """The admitted prompts share one prefill pass; when it fails, each runs alone again from
    the start (whatever the failed pass had done to its state forgotten), so only the prompt
    that fails alone fails and the others give their solo codes."""
    engine = _engine(tiny_model, kernels, max_num_seqs=8, max_num_batched_tokens=1024)
    bad = prompts[2].request_id
    real = engine.runner.prefill

    def prefill(items, attention):
        results = real(items, attention)  # the pass runs (state written), then fails
        if any(item.request.request_id == bad for item in items):
            raise RuntimeError("injected prefill failure")
        return results

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    for prompt, params in zip(prompts, PARAMS):
        engine.add_request(prompt.request_id, prompt, params)
    codes, errors = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.finished:
                codes[out.request_id] = out.output.codes
    assert set(errors) == {bad} and "injected prefill failure" in errors[bad]
    assert set(codes) == set(alone) - {bad}
    for request_id, got in codes.items():
        assert torch.equal(got, alone[request_id][0]), request_id
    assert engine.debug_state_counts() == CLEAN


def test_add_request_validation(tiny_model, prompts):
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    prompt = prompts[0]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request("long", prompt, PARAMS[0])
    # With chunked prefill on, a talker prompt (which its runner computes whole: torch's fused
    # attention) longer than the budget takes a step of its own.
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=16)
    engine.generate("long", prompt, PARAMS[0])
    assert engine.batch_stats()["max_step_tokens"] > 16 and engine.batch_stats()["partial_chunks"] == 0
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    bad_voice = TalkerPrompt(
        "v",
        prompt.prompt_token_ids,
        prompt.output_token_ids,
        prompt.thinker_embeds,
        prompt.thinker_hidden,
        speaker="nobody",
    )
    with pytest.raises(ValueError, match="ethan"):
        engine.add_request("v", bad_voice, PARAMS[0])
    engine.add_request("dup", prompt, PARAMS[0])
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", prompt, PARAMS[0])
    for sizes in ((0, 25), (4,), (4, 25, 1)):
        with pytest.raises(ValueError, match="chunk_sizes"):
            engine.add_request("sizes", prompt, PARAMS[0], stream=True, chunk_sizes=sizes)
    assert engine.debug_state_counts() == {"talker.requests": 1, "talker.kv_blocks_in_use": 0}
    engine.abort_request("dup")
    assert engine.debug_state_counts() == CLEAN
    assert not engine.has_unfinished_requests()


def _chunks(engine, prompt, params, chunk_sizes):
    """The frames of each chunk a streamed request sends, and its final codes."""
    engine.add_request(prompt.request_id, prompt, params, stream=True, chunk_sizes=chunk_sizes)
    chunks, codes = [], None
    while codes is None:
        for out in engine.step():
            assert out.error is None, out.error
            if out.chunk is not None:
                chunks.append(out.chunk)
            if out.finished:
                codes = out.output.codes
    return chunks, codes


@pytest.mark.parametrize("chunk_sizes", [(4, 25), (3, 7), (1, 1)])
def test_streamed_frames_leave_in_the_chunks_asked_for(tiny_model, prompts, chunk_sizes):
    """With chunk_sizes the talker sends its frames in code2wav's chunks (first, then later
    sizes; the remainder with the last step), and they add up to the final codes."""
    prompt, params = prompts[1], PARAMS[1].replace(ignore_eos=True, max_tokens=40)
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    chunks, codes = _chunks(engine, prompt, params, chunk_sizes)
    first, later = chunk_sizes
    frames = codes.shape[1]
    expected = [first] + [later] * ((frames - first) // later)
    if sum(expected) < frames:
        expected.append(frames - sum(expected))
    assert [len(c) for c in chunks] == expected
    assert torch.tensor([f for c in chunks for f in c], dtype=codes.dtype).t().equal(codes)
    # Without sizes, every step's frame is a chunk of its own (the control: sizes change it).
    engine = _engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    unsized, same = _chunks(engine, prompt, params, None)
    assert [len(c) for c in unsized] == [1] * frames and torch.equal(same, codes)
