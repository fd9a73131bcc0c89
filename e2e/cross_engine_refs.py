"""What the cross-engine P/D e2e tests share (test_vllm_p_hf_d.py, test_hf_p_vllm_d.py): the held
prompts, the colocated pipelines they are compared against, and one cache of the colocated
outputs for the whole session.

The colocated pipelines start only when an output is not cached yet (`reference`), so the
second module to run compares against the first one's runs without starting its own vLLM
colocated pipeline. `no_leaks` checks every pipeline a test used: its stages' /debug/state
counts are zero after the test.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

CI = STAGE_CONFIGS_DIR / "ci"
BS = 32  # the mixed pairs' block size (vLLM's block_size, the hf stage's kv_block_size)
COLOCATED = {"vllm": CI / "qwen3_omni_tiny_vllm.yaml", "hf": CI / "qwen3_omni_tiny.yaml"}

TONE = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
PROMPTS: dict[str, Any] = {
    "text": "Please describe, in a few sentences, how tides are made by the moon.",
    "audio": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this sound?"}, {"type": "audio", "audio": TONE}],
        }
    ],
}
_runs: dict[tuple[str, str], Any] = {}  # (pipeline, case) -> its output, for the session
_live: dict[str, Omni] = {}  # the pipelines a module has started, by fixture name


def pipeline(name: str, config) -> Iterator[Omni]:
    """A module's pipeline (a fixture's body), known to `no_leaks` while it runs."""
    with Omni(stage_configs_path=config, request_timeout_s=120) as omni:
        _live[name] = omni
        try:
            yield omni
        finally:
            del _live[name]


@pytest.fixture(scope="module")
def vllm_colocated():
    yield from pipeline("vllm_colocated", COLOCATED["vllm"])


@pytest.fixture(scope="module")
def hf_colocated():
    yield from pipeline("hf_colocated", COLOCATED["hf"])


def run(omni: Omni, name: str, case: str):
    """`omni`'s output for a held prompt, run once per session under `name`."""
    if (name, case) not in _runs:
        _runs[name, case] = omni.generate([PROMPTS[case]], use_tqdm=False)[0]
    return _runs[name, case]


def reference(request, kind: str, case: str):
    """The `kind` ("vllm" or "hf") colocated pipeline's output for a held prompt; the pipeline
    starts only if this session has not run the prompt on it yet."""
    if (kind, case) not in _runs:
        run(request.getfixturevalue(f"{kind}_colocated"), kind, case)
    return _runs[kind, case]


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    for name, omni in _live.items():
        counts = omni.debug_state_counts()
        assert all(v == 0 for v in counts.values()), (name, counts)


def assert_equals_both_colocated(request, got, case: str) -> None:
    """`got` (a mixed pipeline's output for a held prompt) has the tokens and audio of both
    colocated pipelines, which must agree (the test fails if they stop agreeing)."""
    v, h = reference(request, "vllm", case), reference(request, "hf", case)
    assert v.token_ids == h.token_ids, "the two colocated pipelines disagree on tokens: nothing to hold"
    assert got.token_ids == h.token_ids
    assert got.audio is not None and got.audio.numel() > 0
    if v.audio_sha256 != h.audio_sha256:
        pytest.fail(
            f"vLLM and hf colocated audio differ ({case}); mixed equals hf: "
            f"{got.audio_sha256 == h.audio_sha256}, vLLM: {got.audio_sha256 == v.audio_sha256}"
        )
    assert got.audio_sha256 == h.audio_sha256


def chat_ids(omni: Omni, text: str) -> list[int]:
    return omni.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
