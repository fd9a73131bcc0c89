import logging

import pytest
import torch

from omni_pd.engines.base import StageInputs
from omni_pd.models.qwen3_omni.records import TalkerOutput, ThinkerOutput
from omni_pd.models.qwen3_omni.stage_input_processors import StageInputError, talker2code2wav, thinker2talker

PROMPT = list(range(10, 20))
TOKENS = [1, 2, 3, 4]
WIDTH = 8


def _rows(n, start=0):
    return torch.arange(start * WIDTH, (start + n) * WIDTH, dtype=torch.float32).view(n, WIDTH)


def _colocated():
    return ThinkerOutput(
        "r",
        PROMPT,
        TOKENS,
        "",
        "length",
        prompt_embeds=_rows(10),
        prompt_hidden=_rows(10) + 0.5,
        output_embeds=_rows(3, 10),
        output_hidden=_rows(3, 10) + 0.5,
        output_start=10,
    )


def _inputs(upstream, model_config=None, sources=(0,)):
    return StageInputs(
        request_id="r", stage_id=2, source_stage_ids=sources, upstream=upstream, model_config=model_config
    )


def test_colocated_and_pd_legs_merge_to_the_same_talker_input():
    colocated = thinker2talker(_inputs({0: _colocated()}))
    prefill = ThinkerOutput(
        "r", PROMPT, [TOKENS[0]], "", "length", prompt_embeds=_rows(10), prompt_hidden=_rows(10) + 0.5
    )
    decode = ThinkerOutput(
        "r",
        PROMPT,
        TOKENS,
        "",
        "length",
        output_embeds=_rows(3, 10),
        output_hidden=_rows(3, 10) + 0.5,
        output_start=10,
    )
    pd = thinker2talker(_inputs({0: prefill, 1: decode}, sources=(1,)))
    assert torch.equal(pd.thinker_embeds, colocated.thinker_embeds)
    assert torch.equal(pd.thinker_hidden, colocated.thinker_hidden)
    assert pd.thinker_embeds.shape == (13, WIDTH)
    assert pd.output_token_ids == TOKENS and pd.prompt_token_ids == PROMPT


def test_overlap_recomputed_by_the_decode_leg_is_taken_once():
    prefill = ThinkerOutput("r", PROMPT, [1], "", "length", prompt_embeds=_rows(10), prompt_hidden=_rows(10))
    # The decode leg re-ran the last prompt position (9): its copy replaces the prefill's.
    decode = ThinkerOutput(
        "r",
        PROMPT,
        TOKENS,
        "",
        "length",
        output_embeds=_rows(4, 9) + 1000,
        output_hidden=_rows(4, 9),
        output_start=9,
    )
    merged = thinker2talker(_inputs({0: prefill, 1: decode}))
    assert merged.thinker_embeds.shape[0] == 13
    assert torch.equal(merged.thinker_embeds[9], _rows(1, 9)[0] + 1000)
    assert torch.equal(merged.thinker_embeds[:9], _rows(9))


def test_length_mismatch_names_the_request_and_the_lengths():
    bad = _colocated()
    bad.output_embeds = _rows(2, 10)
    bad.output_hidden = _rows(2, 10)
    with pytest.raises(
        StageInputError, match=r"request r: merged embeddings cover 12 positions, expected 13"
    ):
        thinker2talker(_inputs({0: bad}))


def test_width_mismatch_is_reported():
    bad = _colocated()
    bad.output_embeds = torch.zeros(3, WIDTH + 1)
    with pytest.raises(StageInputError, match=r"request r: prompt embeddings have shape \(10, 8\)"):
        thinker2talker(_inputs({0: bad}))


def test_missing_leg_is_reported():
    prefill_only = ThinkerOutput(
        "r", PROMPT, [1], "", "length", prompt_embeds=_rows(10), prompt_hidden=_rows(10)
    )
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


# -- streaming counterparts (async_chunk) ------------------------------------------------------


def _chunks(output, prompt_rows: bool):
    """The chunks a streaming thinker leg sends for `output`, one token per step: the first with
    token 0 (and the prompt rows when the leg prefilled), then one fed-back row and one token."""
    from omni_pd.models.qwen3_omni.records import ThinkerChunk

    empty = torch.zeros((0, WIDTH))
    yield ThinkerChunk(
        [output.token_ids[0]],
        empty,
        output.output_start,
        prompt_token_ids=list(output.prompt_token_ids),
        prompt_embeds=output.prompt_embeds if prompt_rows else None,
        prompt_hidden=output.prompt_hidden if prompt_rows else None,
    )
    for k in range(1, len(output.token_ids)):
        row = slice(k - 1, k)
        yield ThinkerChunk([output.token_ids[k]], output.output_embeds[row], output.output_start + k - 1)


def _streamed_talker_input(feeder, chunks, output):
    """Opening prompt plus every delta, as the talker would accumulate them."""
    opening, tokens, embeds, final = None, [], [], False
    for chunk in chunks:
        feeder.feed(chunk)
        if opening is None:
            opening = feeder.prompt()
            if opening is not None:
                assert not opening.final
                tokens, embeds = list(opening.output_token_ids), [opening.thinker_embeds]
            continue
        delta, final = feeder.take()
        tokens += delta.output_token_ids
        embeds.append(delta.thinker_embeds)
    feeder.close(output)
    delta, final = feeder.take()
    tokens += delta.output_token_ids
    embeds.append(delta.thinker_embeds)
    assert final
    # The talker reads hidden states at prompt positions only: the stream carries just those.
    return opening, tokens, torch.cat(embeds), opening.thinker_hidden


@pytest.mark.parametrize("pd", [False, True])
def test_streamed_thinker_output_adds_up_to_the_merged_talker_input(pd):
    from omni_pd.models.qwen3_omni.stage_input_processors import thinker2talker_stream

    whole_output = _colocated()
    if pd:
        prefill = ThinkerOutput(
            "r", PROMPT, [TOKENS[0]], "", "length", prompt_embeds=_rows(10), prompt_hidden=_rows(10) + 0.5
        )
        decode = ThinkerOutput(
            "r",
            PROMPT,
            TOKENS,
            "",
            "length",
            output_embeds=_rows(3, 10),
            output_hidden=_rows(3, 10) + 0.5,
            output_start=10,
        )
        want = thinker2talker(_inputs({0: prefill, 1: decode}, sources=(1,)))
        feeder = thinker2talker_stream(_inputs({0: prefill}, sources=(1,)))
        opening, tokens, embeds, hidden = _streamed_talker_input(feeder, _chunks(decode, False), decode)
    else:
        want = thinker2talker(_inputs({0: whole_output}))
        feeder = thinker2talker_stream(_inputs({}))
        opening, tokens, embeds, hidden = _streamed_talker_input(
            feeder, _chunks(whole_output, True), whole_output
        )
    # The talker opened as soon as the first generated token's row was there, not at the end.
    assert opening.output_token_ids == TOKENS[:2]
    assert opening.thinker_embeds.shape[0] == len(PROMPT) + 1
    assert tokens == want.output_token_ids
    assert torch.equal(embeds, want.thinker_embeds)
    assert torch.equal(hidden, want.thinker_hidden[: len(PROMPT)])


def test_a_thinker_done_before_the_talker_could_start_gives_the_whole_input():
    from omni_pd.models.qwen3_omni.stage_input_processors import thinker2talker_stream

    output = _colocated()
    feeder = thinker2talker_stream(_inputs({}))
    feeder.close(output)  # no chunks at all (an engine that does not stream rows)
    prompt = feeder.prompt()
    want = thinker2talker(_inputs({0: output}))
    assert prompt.final and torch.equal(prompt.thinker_embeds, want.thinker_embeds)


def test_streamed_tokens_that_disagree_with_the_output_are_an_error():
    from omni_pd.models.qwen3_omni.stage_input_processors import thinker2talker_stream

    output = _colocated()
    feeder = thinker2talker_stream(_inputs({}))
    for chunk in _chunks(output, True):
        feeder.feed(chunk)
    output.token_ids = TOKENS + [5]
    with pytest.raises(StageInputError, match="streamed 4 tokens but its output has 5"):
        feeder.close(output)
