"""Qwen2.5-Omni's thinker on the generic engine (issue 49): its greedy tokens are transformers'
`generate` on the same weights, the talker's input rows are what transformers' `generate` feeds
its talker, and a request's bits do not depend on its batch."""

import pytest
import torch

torch.set_num_threads(1)  # as in a stage worker on this machine

from omni_pd.config import load_pipeline_config
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.models.qwen2_5_omni import factory
from omni_pd.models.qwen2_5_omni.hf.thinker_runner import ThinkerRunner
from omni_pd.models.qwen2_5_omni.pipeline import thinker_eos_ids
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


def test_audio_prompts_are_refused_by_name(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompt = ThinkerPrompt(
        [1, 2, 3], input_features=torch.zeros(1, 128, 10), feature_attention_mask=torch.ones(1, 10)
    )
    with pytest.raises(ValueError, match="text prompts only"):
        engine.generate("a", prompt, SamplingParams(max_tokens=2))
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
