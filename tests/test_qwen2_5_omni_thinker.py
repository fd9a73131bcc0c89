"""Qwen2.5-Omni's thinker on the generic engine (issue 49): its greedy tokens are transformers'
`generate` on the same weights, the talker's input rows are what transformers' `generate` feeds
its talker, and a request's bits do not depend on its batch."""

import numpy as np
import pytest
import torch

torch.set_num_threads(1)  # as in a stage worker on this machine

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.models.qwen2_5_omni import factory
from omni_pd.models.qwen2_5_omni.hf.thinker_runner import ThinkerRunner
from omni_pd.models.omni_prompt import OmniPrompt
from omni_pd.models.qwen2_5_omni.pipeline import thinker_eos_ids
from omni_pd.models.qwen2_5_omni.prompt import PromptBuilder
from omni_pd.models.qwen2_5_omni.records import ThinkerPrompt
from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness

CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_thinker.yaml"
TEXTS = ["hi", "tell me about the sea", "x" * 50, "what is two plus two?", "bonjour", "count to ten"]


@pytest.fixture(scope="module")
def source():
    return factory.resolve_model(TINY_MODEL_NAME)


@pytest.fixture(scope="module")
def tokenizer(source):
    return factory.load_tokenizer(source)


@pytest.fixture(scope="module")
def model(source):
    return factory.build_dummy_model(factory.load_config(source), seed=42)


def _engine(model, tokenizer, **engine_args):
    stage = load_pipeline_config(CONFIG).stage(0)
    stage = stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})
    runner = ThinkerRunner(
        model.thinker, tokenizer, thinker_eos_ids(tokenizer), stage.engine_args.attention_kernels
    )
    return ar_engine(stage, runner)


def _prompts(tokenizer):
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in TEXTS
    ]


def _transformers(model, ids, new_tokens):
    """transformers' greedy generate: its tokens, and the rows its `generate` feeds the talker
    (last hidden state + layer 0, per prompt position and per fed-back token)."""
    with torch.no_grad():
        out = model.thinker.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    steps = out.hidden_states
    rows = [steps[0][-1][0] + steps[0][0][0]] + [s[-1][0, -1:] + s[0][0, -1:] for s in steps[1:]]
    return out.sequences[0, len(ids) :].tolist(), torch.cat(rows)


def test_greedy_tokens_and_talker_rows_are_transformers(model, tokenizer):
    engine = _engine(model, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(_prompts(tokenizer)):
        ours = engine.generate(f"r{i}", prompt, params)
        tokens, rows = _transformers(model, prompt.prompt_token_ids, 12)
        assert ours.token_ids == tokens, TEXTS[i]
        mine = torch.cat([ours.prompt_rows, ours.output_rows])
        assert mine.shape == rows.shape  # the last token is never fed back
        assert torch.allclose(mine, rows, atol=1e-5, rtol=1e-4), TEXTS[i]
    # Negative control: another seed's weights give other tokens, so the comparison can fail.
    other = factory.build_dummy_model(model.config, seed=43)
    prompt = _prompts(tokenizer)[1]
    assert (
        _transformers(other, prompt.prompt_token_ids, 12)[0] != engine.generate("c", prompt, params).token_ids
    )
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def _together(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params[i])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outputs[out.request_id] = out.output
    return [outputs[f"t{i}"] for i in range(len(prompts))]


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.prompt_rows, b.prompt_rows)
        and torch.equal(a.output_rows, b.output_rows)
    )


def test_batched_requests_equal_their_solo_runs(model, tokenizer):
    prompts = _prompts(tokenizer)
    params = [
        SamplingParams(temperature=0, max_tokens=10 + i % 3)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=100 + i)
        for i in range(len(prompts))
    ]
    engine = _engine(model, tokenizer)
    solo = [engine.generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts)]
    together = _together(engine, prompts, params)
    assert engine.batch_stats()["max_decode_batch"] == len(prompts)
    assert all(_same(a, b) for a, b in zip(solo, together))
    # Negative control: without the fixed row tiles, batching moves the bits.
    with bi.disabled():
        solo = [engine.generate(f"u{i}", p, params[i]) for i, p in enumerate(prompts)]
        together = _together(engine, prompts, params)
    assert not all(_same(a, b) for a, b in zip(solo, together))


def test_the_tiny_model_is_seeded_and_round_trips_through_a_checkpoint(model, tmp_path):
    from omni_pd.models.qwen3_omni.factory import weights_fingerprint

    again = factory.build_dummy_model(model.config, seed=42)
    assert weights_fingerprint(again) == weights_fingerprint(model)
    directory = factory.save_tiny_model(tmp_path / "ckpt", seed=42)
    loaded = factory.load_model(str(directory))
    assert weights_fingerprint(loaded) == weights_fingerprint(model)
    voices = factory.load_speakers(factory.resolve_model(str(directory)))
    assert set(voices) == {"Chelsie", "Ethan"} and torch.equal(
        voices["Ethan"]["cond"], model.speaker_map["Ethan"]["cond"]
    )
    (directory / factory.SPEAKERS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="spk_dict.pt"):
        factory.load_speakers(factory.resolve_model(str(directory)))


TONE = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)


def _audio_prompt(model, tokenizer, text="What is this sound?", audio=TONE):
    builder = PromptBuilder(tokenizer, model.config.thinker_config)
    content = [{"type": "text", "text": text}, {"type": "audio", "audio": audio}]
    return builder.build(OmniPrompt(messages=[{"role": "user", "content": content}]))


def test_audio_prompts_are_transformers_and_batch_invariant(model, tokenizer):
    """An audio prompt: transformers' greedy tokens, and its talker rows with the embedding zeroed
    at the audio placeholders (as transformers' generate masks them); alone = beside others."""
    prompt = _audio_prompt(model, tokenizer)
    ids = prompt.prompt_token_ids
    engine = _engine(model, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ours = engine.generate("a", prompt, params)
    with torch.no_grad():
        out = model.thinker.generate(
            torch.tensor([ids]),
            input_features=prompt.input_features,
            feature_attention_mask=prompt.feature_attention_mask,
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert out.sequences[0, len(ids) :].tolist() == ours.token_ids
    steps = out.hidden_states
    embeds = steps[0][0][0].clone()
    embeds[torch.tensor(ids) == model.config.thinker_config.audio_token_index] = 0
    rows = torch.cat([steps[0][-1][0] + embeds] + [s[-1][0, -1:] + s[0][0, -1:] for s in steps[1:]])
    assert torch.allclose(torch.cat([ours.prompt_rows, ours.output_rows]), rows, atol=1e-5, rtol=1e-4)
    # Negative control: another clip is another answer's rows.
    other = engine.generate("b", _audio_prompt(model, tokenizer, audio=TONE[::-1].copy()), params)
    assert not torch.equal(other.prompt_rows, ours.prompt_rows)
    # Beside text prompts in one batch, the same bits.
    prompts = [prompt] + _prompts(tokenizer)[:3]
    together = _together(engine, prompts, [params] * len(prompts))
    assert _same(together[0], ours)


def test_malformed_multimodal_prompts_are_refused_by_name(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompt = _audio_prompt(model, tokenizer)
    audio = model.config.thinker_config.audio_token_index
    short = ThinkerPrompt(
        [t for i, t in enumerate(prompt.prompt_token_ids) if t != audio or i % 2],
        input_features=prompt.input_features,
        feature_attention_mask=prompt.feature_attention_mask,
    )
    with pytest.raises(ValueError, match="placeholder"):
        engine.generate("a", short, SamplingParams(max_tokens=2))
    image = ThinkerPrompt([1, 2, model.config.thinker_config.image_token_index, 3])
    with pytest.raises(ValueError, match="without images or video"):
        engine.generate("i", image, SamplingParams(max_tokens=2))
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def _turns(model, tokenizer):
    """A conversation of three turns, the first with audio: each turn's prompt starts with the
    previous one's."""
    builder = PromptBuilder(tokenizer, model.config.thinker_config)
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hear this."}, {"type": "audio", "audio": TONE}],
        }
    ]
    prompts = []
    for reply in ("a tone", "it is high", "goodbye"):
        prompts.append(builder.build(OmniPrompt(messages=list(history))))
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then? " * 6}]
    return prompts


def test_turns_over_cached_blocks_equal_uncached_bit_for_bit(model, tokenizer):
    prompts, params = _turns(model, tokenizer), SamplingParams(temperature=0, max_tokens=6)
    uncached = _engine(model, tokenizer, enable_prefix_caching=False)
    want = [uncached.generate(f"u{i}", p, params) for i, p in enumerate(prompts)]
    cached = _engine(model, tokenizer)
    got = [cached.generate(f"c{i}", p, params) for i, p in enumerate(prompts)]
    hits = [o.metrics["prefix_cached_tokens"] for o in got]
    assert hits[0] == 0 and all(h >= 3 * 16 for h in hits[1:]), hits  # the history (audio too) came cached
    assert all(_same(a, b) for a, b in zip(want, got))
    # Negative control: a byte of a cached block flipped before the next turn reuses it is noticed.
    engine = _engine(model, tokenizer)
    engine.generate("n0", prompts[0], params)
    engine.kv.cache.data[:, 0, 0, 0, 0, 0] += 1.0  # every block, the cached ones among them
    flipped = engine.generate("n1", prompts[1], params)
    assert flipped.metrics["prefix_cached_tokens"] > 0 and not _same(want[1], flipped)
