"""The talker fed while its thinker runs (async_chunk): it starts on the first generated token,
takes later tokens as they come, waits when it catches up, and produces exactly the codes of a
talker given the whole thinker output."""

import pytest
import torch

from omni_pd.models.qwen3_omni.records import TalkerInputDelta, TalkerPrompt
from test_talker_batch import CLEAN, PARAMS, _engine, _same  # noqa: F401 - shared fixtures below
from test_talker_batch import _one_thread, alone, kernels, prompts  # noqa: F401

pytestmark = pytest.mark.exactness


def _opening(prompt: TalkerPrompt, tokens: int) -> TalkerPrompt:
    """What the talker gets when the thinker has generated `tokens` tokens (all but the latest
    fed back)."""
    rows = len(prompt.prompt_token_ids) + tokens - 1
    return TalkerPrompt(
        prompt.request_id,
        prompt.prompt_token_ids,
        prompt.output_token_ids[:tokens],
        prompt.thinker_embeds[:rows],
        prompt.thinker_hidden[: len(prompt.prompt_token_ids)],  # all it reads
        prompt.speaker,
        final=False,
    )


def _delta(prompt: TalkerPrompt, tokens_before: int, tokens_after: int) -> TalkerInputDelta:
    base = len(prompt.prompt_token_ids) - 1
    rows = slice(base + tokens_before, base + min(tokens_after, len(prompt.output_token_ids)))
    return TalkerInputDelta(prompt.output_token_ids[tokens_before:tokens_after], prompt.thinker_embeds[rows])


def _run_streamed(engine, prompt, params, steps_per_token: int, final_after: int | None = None):
    """Open the talker at 2 tokens, then give it one more token every `steps_per_token` steps
    (or stop short: final after `final_after` tokens). Returns (codes, trace, waits): waits
    counts the times the talker had caught up with the thinker and had nothing to do."""
    total = len(prompt.output_token_ids) if final_after is None else final_after
    engine.add_request(prompt.request_id, _opening(prompt, 2), params)
    given, waits, result = 2, 0, None
    while result is None:
        for _ in range(steps_per_token):
            if not engine.has_unfinished_requests():
                waits += 1
                break
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    state_trace = out.output.codes
                    result = state_trace
        if given <= total and result is None:
            engine.append_input(prompt.request_id, _delta(prompt, given, given + 1), final=given == total)
            given += 1
    return result, waits


@pytest.mark.parametrize("index", range(6))
def test_streamed_talker_equals_the_whole_talker(tiny_model, prompts, alone, kernels, index):  # noqa: F811
    engine = _engine(tiny_model, kernels, max_num_seqs=8, max_num_batched_tokens=256)
    codes, waits = _run_streamed(engine, prompts[index], PARAMS[index], steps_per_token=1)
    want_codes, _ = alone[prompts[index].request_id]
    assert torch.equal(codes, want_codes)
    assert engine.debug_state_counts() == CLEAN


def test_talker_waits_for_the_thinker_instead_of_guessing(tiny_model, prompts, alone, kernels):  # noqa: F811
    """Given tokens slower than it can use them, the talker runs out of trailing rows and stops
    stepping that request (no step without its row) until the next token comes."""
    index = 2  # the longest output
    engine = _engine(tiny_model, kernels, max_num_seqs=8, max_num_batched_tokens=256)
    codes, waits = _run_streamed(engine, prompts[index], PARAMS[index], steps_per_token=5)
    assert waits >= len(prompts[index].output_token_ids) - 3
    assert torch.equal(codes, alone[prompts[index].request_id][0])


def test_negative_control_ending_the_text_early_changes_the_codes(tiny_model, prompts, alone, kernels):  # noqa: F811
    index = 2
    engine = _engine(tiny_model, kernels, max_num_seqs=8, max_num_batched_tokens=256)
    codes, _ = _run_streamed(engine, prompts[index], PARAMS[index], steps_per_token=1, final_after=4)
    assert not torch.equal(codes, alone[prompts[index].request_id][0])


def test_rows_projected_together_equal_rows_projected_per_request(tiny_model, prompts):  # noqa: F811
    """A step projects every request's new thinker rows in one pass: each request's trailing rows
    are the ones it gets alone. Control: plain F.linear over the same pass does not give every
    row its solo bits (what the tiles in the projection prevent)."""
    runner = _engine(tiny_model, "native", max_num_seqs=8, max_num_batched_tokens=256).runner.runner
    wanted = [(_opening(p, min(len(p.output_token_ids), 6 + i)), i % 3, False) for i, p in enumerate(prompts)]
    together = runner.trailing_rows_many(wanted)
    alone_rows = [runner.trailing_rows(*item) for item in wanted]
    assert sum(rows.shape[0] for rows in together) > len(wanted)
    assert all(torch.equal(a, b) for a, b in zip(together, alone_rows))
    mlp = runner.talker.text_projection

    def plain(rows):
        return torch.nn.functional.linear(
            mlp.act_fn(torch.nn.functional.linear(rows, mlp.linear_fc1.weight, mlp.linear_fc1.bias)),
            mlp.linear_fc2.weight,
            mlp.linear_fc2.bias,
        )

    raw = [item[0].thinker_embeds[runner._assistant_start(item[0]) + 4 + item[1] :][:1] for item in wanted]
    one_pass = plain(torch.cat(raw))
    assert not all(torch.equal(one_pass[i], plain(r)[0]) for i, r in enumerate(raw))
