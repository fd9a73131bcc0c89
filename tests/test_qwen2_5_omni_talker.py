"""Qwen2.5-Omni's talker on the generic engine (issue 49): its greedy codes are what transformers'
talker computes from the same thinker output, a request's codes do not depend on its batch, and
malformed input is refused by name.

The reference is transformers' talker forward, driven step by step with its KV cache and its own
logits processors, given an attention mask: with a mask, its forward sets up the prompt as the
model intends (the codec pad and bos embeddings added to the last two rows). transformers 5.19's
`Qwen2_5OmniForConditionalGeneration.generate` drops an all-ones mask before the talker's forward,
so it skips that setup; the negative control shows the two differ."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

torch.set_num_threads(1)

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.models.qwen2_5_omni import factory
from omni_pd.models.qwen2_5_omni.hf.talker_runner import TalkerRunner, Voices
from omni_pd.models.qwen2_5_omni.hf.thinker_runner import ThinkerRunner
from omni_pd.models.omni_prompt import OmniPrompt
from omni_pd.models.qwen2_5_omni.pipeline import thinker_eos_ids
from omni_pd.models.qwen2_5_omni.prompt import PromptBuilder
from omni_pd.models.qwen2_5_omni.records import TalkerInputDelta, TalkerPrompt
from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME, VOICES
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness

CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_thinker.yaml"
TEXTS = ["hi", "tell me about the sea", "count to ten", "x" * 40, "bonjour"]
GREEDY = SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def model():
    return factory.build_dummy_model(factory.load_config(factory.resolve_model(TINY_MODEL_NAME)), seed=42)


@pytest.fixture(scope="module")
def talker_prompts(model):
    """Each text's thinker output (greedy, 10 tokens) as the talker's prompt."""
    tokenizer = factory.load_tokenizer(factory.resolve_model(TINY_MODEL_NAME))
    stage = load_pipeline_config(CONFIG).stage(0)
    thinker = ar_engine(stage, ThinkerRunner(model.thinker, tokenizer, thinker_eos_ids(tokenizer)))
    builder = PromptBuilder(tokenizer, model.config.thinker_config)
    tone = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
    audio = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is it?"}, {"type": "audio", "audio": tone}],
        }
    ]
    messages = [[{"role": "user", "content": text}] for text in TEXTS] + [audio]  # the last: an audio prompt
    prompts = []
    for i, message in enumerate(messages):
        prompt = builder.build(OmniPrompt(messages=message))
        out = thinker.generate(f"t{i}", prompt, SamplingParams(temperature=0, max_tokens=10))
        rows = torch.cat([out.prompt_rows, out.output_rows])
        prompts.append(TalkerPrompt(f"k{i}", prompt.prompt_token_ids, out.token_ids, rows, speaker="chelsie"))
    return prompts


def _engine(model, trace=False, **engine_args):
    stage = load_pipeline_config(CONFIG).stage(0)
    stage = stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})
    runner = TalkerRunner(
        model.talker, model.thinker.get_input_embeddings(), Voices(model.speaker_map), trace=trace
    )
    return ar_engine(stage, runner)


@torch.no_grad()
def _transformers_codes(model, prompt: TalkerPrompt, steps: int, masked: bool = True) -> list[int]:
    talker, embed, c = model.talker, model.thinker.get_input_embeddings(), model.talker.config
    length, rows = len(prompt.prompt_token_ids), prompt.rows
    bos = VOICES["Chelsie"]
    raw = torch.cat([rows[:length], embed(torch.tensor([bos])), rows[length : length + 1]]).unsqueeze(0)
    reply = torch.cat(
        [rows[length + 1 :], embed(torch.tensor([c.tts_text_end_token_id, c.tts_text_pad_token_id]))]
    )
    seq = torch.tensor(
        [[c.tts_codec_mask_token_id] * length + [c.tts_codec_pad_token_id, c.tts_codec_start_token_id]]
    )
    text_ids = torch.tensor([list(prompt.prompt_token_ids) + [bos, prompt.output_token_ids[0]]])
    processors = [
        RepetitionPenaltyLogitsProcessor(1.05),
        SuppressTokensLogitsProcessor([c.tts_codec_start_token_id]),
    ]
    cache, stops = DynamicCache(config=c), (c.tts_codec_pad_token_id, c.tts_codec_end_token_id)
    talker.rope_deltas = None

    def mask():
        return torch.ones_like(seq) if masked else None

    out = talker(
        input_ids=seq,
        input_text_ids=text_ids,
        inputs_embeds=raw,
        attention_mask=mask(),
        thinker_reply_part=reply.unsqueeze(0),
        past_key_values=cache,
    )
    codes: list[int] = []
    for _ in range(steps):
        scores = out.logits[:, -1].float()
        for processor in processors:
            scores = processor(seq, scores)
        code = int(scores.argmax(-1))
        seq = torch.cat([seq, torch.tensor([[code]])], dim=1)
        if code in stops:
            break
        codes.append(code)
        out = talker(
            input_ids=torch.tensor([[code]]),
            attention_mask=mask(),
            thinker_reply_part=out.thinker_reply_part,
            past_key_values=cache,
        )
    return codes


def test_greedy_codes_are_transformers_talkers(model, talker_prompts):
    engine = _engine(model)
    for prompt in talker_prompts:
        ours = engine.generate(prompt.request_id, prompt, GREEDY)
        assert ours.codes.tolist() == _transformers_codes(model, prompt, GREEDY.max_tokens), prompt.request_id
    # Negative control: without the mask transformers' forward skips the codec pad/bos setup (what
    # its generate does in 5.19), and the codes differ.
    prompt = talker_prompts[0]
    assert (
        _transformers_codes(model, prompt, 30, masked=False)
        != engine.generate("c", prompt, GREEDY).codes.tolist()[:30]
    )
    assert engine.debug_state_counts() == {"talker.requests": 0, "talker.kv_blocks_in_use": 0}


def _together(engine, prompts, params):
    for prompt, p in zip(prompts, params):
        engine.add_request("b" + prompt.request_id, prompt, p)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outputs[out.request_id] = out.output
    return [outputs["b" + p.request_id] for p in prompts]


def test_batched_requests_equal_their_solo_runs(model, talker_prompts):
    params = [
        GREEDY
        if i % 2 == 0
        else SamplingParams(
            temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=50, seed=i
        )
        for i in range(len(talker_prompts))
    ]
    engine = _engine(model, trace=True)

    def same(a, b) -> bool:
        return torch.equal(a.codes, b.codes) and torch.equal(a.logits, b.logits)

    solo = [engine.generate("s" + p.request_id, p, q) for p, q in zip(talker_prompts, params)]
    together = _together(engine, talker_prompts, params)
    assert engine.batch_stats()["max_decode_batch"] == len(talker_prompts)
    assert all(same(a, b) for a, b in zip(solo, together))
    with bi.disabled():  # negative control: without the fixed row tiles, batching moves the bits
        solo = [engine.generate("u" + p.request_id, p, q) for p, q in zip(talker_prompts, params)]
        together = _together(engine, talker_prompts, params)
    assert not all(same(a, b) for a, b in zip(solo, together))


def _fed_while_the_thinker_runs(engine, prompts, params):
    """Each request opened with its first fed-back token's row (as `thinker2talker_stream` opens
    it) and given one more thinker token and row every other talker step, all in one engine."""
    given = {}
    for prompt, p in zip(prompts, params):
        length = len(prompt.prompt_token_ids)
        first = TalkerPrompt(
            prompt.request_id, prompt.prompt_token_ids, prompt.output_token_ids[:2],
            prompt.rows[: length + 1], prompt.speaker, final=False,
        )  # fmt: skip
        engine.add_request("f" + prompt.request_id, first, p)
        given[prompt.request_id] = 2
    outputs, step = {}, 0
    while len(outputs) < len(prompts):  # a request waiting for its row is not work for the engine
        assert step < 1000
        for prompt in prompts:
            n, length = given[prompt.request_id], len(prompt.prompt_token_ids)
            if step % 2 == 0 and n < len(prompt.output_token_ids):
                delta = TalkerInputDelta(
                    [prompt.output_token_ids[n]], prompt.rows[length + n - 1 : length + n]
                )
                engine.append_input(
                    "f" + prompt.request_id, delta, final=n + 1 == len(prompt.output_token_ids)
                )
                given[prompt.request_id] = n + 1
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outputs[out.request_id] = out.output
        step += 1
    return [outputs["f" + p.request_id] for p in prompts]


def test_a_talker_fed_while_its_thinker_runs_gives_the_whole_outputs_codes(model, talker_prompts):
    """A talker started from the thinker's second token waits, step by step, for the reply row
    it reads next: its codes and logits are those it computes from the whole output. Negative
    control: a talker that does not wait reads the last row it has and speaks otherwise."""
    params = [
        GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=40, max_tokens=50, seed=i)
        for i in range(len(talker_prompts))
    ]
    engine = _engine(model, trace=True)
    whole = [engine.generate("w" + p.request_id, p, q) for p, q in zip(talker_prompts, params)]
    fed = _fed_while_the_thinker_runs(engine, talker_prompts, params)
    for a, b in zip(whole, fed):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.logits, b.logits)
    assert engine.debug_state_counts() == {"talker.requests": 0, "talker.kv_blocks_in_use": 0}
    engine.runner.ready = lambda request: True
    hasty = _fed_while_the_thinker_runs(engine, talker_prompts, params)
    assert not all(torch.equal(a.codes, b.codes) for a, b in zip(whole, hasty))


def test_malformed_talker_input_is_refused_by_name(model, talker_prompts):
    engine = _engine(model)
    good = talker_prompts[0]
    cases = [
        (
            TalkerPrompt("v", good.prompt_token_ids, good.output_token_ids, good.rows, speaker="nobody"),
            "voice 'nobody'",
        ),
        (
            TalkerPrompt(
                "o", good.prompt_token_ids, good.output_token_ids[:1], good.rows[: len(good.prompt_token_ids)]
            ),
            "at least two thinker tokens",
        ),
        (TalkerPrompt("r", good.prompt_token_ids, good.output_token_ids, good.rows[:-1]), "rows cover"),
    ]
    for prompt, needle in cases:
        with pytest.raises(ValueError, match=needle):
            engine.generate(prompt.request_id, prompt, GREEDY)
    assert engine.debug_state_counts() == {"talker.requests": 0, "talker.kv_blocks_in_use": 0}
