"""vLLM tests: skipped with an install hint outside CI when vLLM is missing, failed under CI=true
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
