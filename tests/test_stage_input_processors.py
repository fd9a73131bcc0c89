import logging

import pytest
import torch

from omni_pd.engines.base import StageInputs
from omni_pd.engines.types import TalkerOutput, ThinkerOutput
from omni_pd.models.qwen3_omni.stage_input_processors import (StageInputError, talker2code2wav,
                                                              thinker2talker)

PROMPT = list(range(10, 20))
TOKENS = [1, 2, 3, 4]
WIDTH = 8


def _rows(n, start=0):
    return torch.arange(start * WIDTH, (start + n) * WIDTH, dtype=torch.float32).view(n, WIDTH)


def _colocated():
    return ThinkerOutput("r", PROMPT, TOKENS, "", "length", prompt_embeds=_rows(10),
                         prompt_hidden=_rows(10) + 0.5, output_embeds=_rows(3, 10),
                         output_hidden=_rows(3, 10) + 0.5, output_start=10)


def _inputs(upstream, model_config=None, sources=(0,)):
    return StageInputs(request_id="r", stage_id=2, source_stage_ids=sources, upstream=upstream,
                       model_config=model_config)


def test_colocated_and_pd_legs_merge_to_the_same_talker_input():
    colocated = thinker2talker(_inputs({0: _colocated()}))
    prefill = ThinkerOutput("r", PROMPT, [TOKENS[0]], "", "length", prompt_embeds=_rows(10),
                            prompt_hidden=_rows(10) + 0.5)
    decode = ThinkerOutput("r", PROMPT, TOKENS, "", "length", output_embeds=_rows(3, 10),
                           output_hidden=_rows(3, 10) + 0.5, output_start=10)
    pd = thinker2talker(_inputs({0: prefill, 1: decode}, sources=(1,)))
    assert torch.equal(pd.thinker_embeds, colocated.thinker_embeds)
    assert torch.equal(pd.thinker_hidden, colocated.thinker_hidden)
    assert pd.thinker_embeds.shape == (13, WIDTH)
    assert pd.output_token_ids == TOKENS and pd.prompt_token_ids == PROMPT


def test_overlap_recomputed_by_the_decode_leg_is_taken_once():
    prefill = ThinkerOutput("r", PROMPT, [1], "", "length", prompt_embeds=_rows(10),
                            prompt_hidden=_rows(10))
    # The decode leg re-ran the last prompt position (9): its copy replaces the prefill's.
    decode = ThinkerOutput("r", PROMPT, TOKENS, "", "length", output_embeds=_rows(4, 9) + 1000,
                           output_hidden=_rows(4, 9), output_start=9)
    merged = thinker2talker(_inputs({0: prefill, 1: decode}))
    assert merged.thinker_embeds.shape[0] == 13
    assert torch.equal(merged.thinker_embeds[9], _rows(1, 9)[0] + 1000)
    assert torch.equal(merged.thinker_embeds[:9], _rows(9))


def test_length_mismatch_names_the_request_and_the_lengths():
    bad = _colocated()
    bad.output_embeds = _rows(2, 10)
    bad.output_hidden = _rows(2, 10)
    with pytest.raises(StageInputError, match=r"request r: merged embeddings cover 12 positions, expected 13"):
        thinker2talker(_inputs({0: bad}))


def test_width_mismatch_is_reported():
    bad = _colocated()
    bad.output_embeds = torch.zeros(3, WIDTH + 1)
    with pytest.raises(StageInputError, match=r"request r: prompt embeddings have shape \(10, 8\)"):
        thinker2talker(_inputs({0: bad}))


def test_missing_leg_is_reported():
    prefill_only = ThinkerOutput("r", PROMPT, [1], "", "length", prompt_embeds=_rows(10),
                                 prompt_hidden=_rows(10))
    with pytest.raises(StageInputError, match="exactly one thinker output"):
        thinker2talker(_inputs({0: prefill_only}))


def test_codes_are_bounded_with_a_warning(tiny_model, caplog):
    cfg = tiny_model.config
    groups, book = cfg.code2wav_config.num_quantizers, cfg.code2wav_config.codebook_size
    codes = torch.randint(0, book, (groups, 12), generator=torch.Generator().manual_seed(0))
    ok = talker2code2wav(_inputs({1: TalkerOutput("r", codes)}, cfg, sources=(1,)))
    assert torch.equal(ok.codes, codes)
    codes[2, 7] = book + 3  # a control code the codebook has no entry for
    with caplog.at_level(logging.WARNING):
        cut = talker2code2wav(_inputs({1: TalkerOutput("r", codes)}, cfg, sources=(1,)))
    assert torch.equal(cut.codes, codes[:, :7])
    assert "takes 7 of 12 codec frames" in caplog.text
    with pytest.raises(StageInputError, match="code2wav takes"):
        talker2code2wav(_inputs({1: TalkerOutput("r", codes[:2])}, cfg, sources=(1,)))
