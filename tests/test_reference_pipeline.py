"""omni-pd's split stages (our thinker loop, talker input builder, code2wav) against transformers'
own single-process `Qwen3OmniMoeForConditionalGeneration.generate`."""

import torch

from omni_pd.models.qwen3_omni.hf.code2wav_runner import Code2WavModel
from omni_pd.models.qwen3_omni.hf.talker_model import TalkerModel
from omni_pd.models.qwen3_omni.hf.thinker_model import ThinkerModel
from omni_pd.models.qwen3_omni.records import Code2WavPrompt, TalkerPrompt, ThinkerPrompt
from omni_pd.sampling import SamplingParams

IM_END = 261


def _split_pipeline(model, tokenizer, ids, thinker_params, talker_params):
    thinker = ThinkerModel(model.thinker, tokenizer, model.config.talker_config.accept_hidden_layer, {IM_END})
    pre = thinker.prefill(ThinkerPrompt(ids), thinker_params)
    dec = thinker.decode(ids, pre.cache, pre.rope_deltas, pre.first_token, thinker_params)
    prompt = TalkerPrompt(
        "r",
        ids,
        dec.token_ids,
        torch.cat([pre.prompt_embeds, dec.output_embeds]),
        torch.cat([pre.prompt_hidden, dec.output_hidden]),
    )
    codes = (
        TalkerModel(model.talker, model.thinker.get_input_embeddings(), model.config)
        .generate(prompt, talker_params)
        .codes
    )
    audio = Code2WavModel(model.code2wav).generate(Code2WavPrompt("r", codes)).audio
    return dec.token_ids, audio


def _reference(model, ids, max_tokens, eos, talker_params):
    torch.manual_seed(talker_params.seed)
    seq, wav = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        thinker_max_new_tokens=max_tokens,
        thinker_eos_token_id=eos,
        thinker_do_sample=False,
        talker_max_new_tokens=talker_params.max_tokens,
        talker_temperature=talker_params.temperature,
        talker_top_k=talker_params.top_k,
        talker_repetition_penalty=talker_params.repetition_penalty,
        speaker="ethan",
    )
    return seq[0, len(ids) :].tolist(), wav.reshape(-1).float()


def test_split_stages_equal_transformers_generate(tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    talker = SamplingParams(temperature=0.9, top_k=50, max_tokens=48, seed=42, repetition_penalty=1.05)
    tokens, audio = _split_pipeline(
        tiny_model, tiny_tokenizer, ids, SamplingParams(temperature=0, max_tokens=10), talker
    )
    ref_tokens, ref_audio = _reference(tiny_model, ids, 10, IM_END, talker)
    assert tokens == ref_tokens
    # code2wav runs length-invariant kernels (models/qwen3_omni/hf/code2wav_exact.py) so that streamed
    # chunks equal the whole waveform exactly; against transformers' own kernels that costs the
    # last bits only.
    assert audio.shape == ref_audio.shape and audio.numel() > 0
    assert (audio - ref_audio).abs().max() <= 1e-5 * ref_audio.abs().max()
    assert not torch.equal(audio, torch.zeros_like(audio))


def test_talker_text_ends_at_the_thinkers_end_of_turn(tiny_model, tiny_tokenizer):
    """transformers moves tts_eos to just after the first end-of-turn token and pads the rest."""
    ids = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    width = tiny_model.config.thinker_config.text_config.hidden_size
    generated = [72, 105, IM_END, 33, 33]
    rows = len(ids) + len(generated) - 1
    embeds = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    runner = TalkerModel(tiny_model.talker, tiny_model.thinker.get_input_embeddings(), tiny_model.config)
    inputs = runner.build_inputs(TalkerPrompt("r", ids, generated, embeds, embeds.clone()))
    trailing, pad = inputs["trailing_text_hidden"][0], inputs["tts_pad_embed"][0, 0]
    cfg = tiny_model.config
    with torch.no_grad():
        eos = tiny_model.talker.text_projection(
            tiny_model.thinker.get_input_embeddings()(torch.tensor([[cfg.tts_eos_token_id]]))
        )[0, 0]
    eos_at = generated.index(IM_END)
    assert torch.allclose(trailing[eos_at], eos, atol=1e-7)  # batched vs single projection
    assert all(torch.equal(row, pad) for row in trailing[eos_at + 1 :])
    assert not torch.equal(trailing[eos_at - 1], pad)
    # Without an end-of-turn the text runs to the last entry, which is tts_eos.
    inputs = runner.build_inputs(
        TalkerPrompt("r", ids, [72, 105, 33], embeds[: len(ids) + 2], embeds[: len(ids) + 2].clone())
    )
    assert torch.allclose(inputs["trailing_text_hidden"][0, -1], eos, atol=1e-7)
