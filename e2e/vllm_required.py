"""What the vLLM tests share (tests/ and e2e/; pytest puts this folder on the path).

`require_vllm`: skipped with an install hint outside CI when vLLM is missing, failed under CI=true
(the test command installs vLLM, so a missing one there is a broken setup, never a skip)."""

from __future__ import annotations

import os

import pytest

from omni_pd.engines.vllm import INSTALL_HINT, vllm_available


def require_vllm() -> None:
    """Call at module level, before importing anything that needs vLLM."""
    if vllm_available():
        return
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI=true but {INSTALL_HINT}", pytrace=False)
    pytest.skip(INSTALL_HINT, allow_module_level=True)


# Token-id prompts of different lengths for the tiny text model (its vocabulary has 272 ids);
# "d" spans more than one 32-token KV block.
TOKEN_PROMPTS = {
    "a": [72, 101, 108, 108, 111],
    "b": [97, 98, 99],
    "c": [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110],
    "d": [(7 * i + 30) % 250 + 1 for i in range(45)],
}
