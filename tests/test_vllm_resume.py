"""When a vLLM decode leg starts from the prefill's first token, and when it takes vLLM's way
(engines/vllm/resume.py): a pure decision, checked case by case."""

from __future__ import annotations

import pytest

from omni_pd import SamplingParams
from omni_pd.engines.vllm.patches.decode_resume import REMOTE_TOKENS_KEY
from omni_pd.engines.vllm.resume import Resume, resume_from

EOS = frozenset({7})
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_a_plain_decode_leg_resumes_with_one_token_fewer_and_the_kv_extent():
    resume = resume_from({"first_token": 5}, GREEDY, 10, EOS)
    assert resume == Resume(first_token=5, prompt_tokens=10)
    prompt = resume.vllm_prompt({"prompt_token_ids": [1, 2], "multi_modal_data": {"audio": "x"}})
    assert prompt == {"prompt_token_ids": [1, 2, 5], "multi_modal_data": {"audio": "x"}}
    params = resume.params(GREEDY.replace(kv_transfer_params={"transfer_id": "t"}))
    assert params.max_tokens == 7
    assert params.kv_transfer_params == {"transfer_id": "t", REMOTE_TOKENS_KEY: 10}


@pytest.mark.parametrize(
    "kv, params",
    [
        ({}, GREEDY),  # no first token from the prefill leg
        ({"first_token": True}, GREEDY),  # not an int
        ({"first_token": 5}, GREEDY.replace(max_tokens=1)),  # nothing left to decode
        ({"first_token": 5}, GREEDY.replace(stop=("ab",))),  # a stop string could start in it
        ({"first_token": 5}, SamplingParams(temperature=0.5, seed=3)),  # its draw must happen
        ({"first_token": 5}, GREEDY.replace(stop_token_ids=(5,))),  # it ends the request
        ({"first_token": 7}, GREEDY),  # EOS ends the request
    ],
)
def test_vllms_way_where_resuming_would_change_the_answer(kv, params):
    assert resume_from(kv, params, 10, EOS) is None


def test_eos_is_only_an_end_without_ignore_eos_and_unseeded_sampling_resumes():
    assert resume_from({"first_token": 7}, GREEDY.replace(ignore_eos=True), 10, EOS) is not None
    assert resume_from({"first_token": 5}, SamplingParams(temperature=0.5), 10, EOS) is not None
