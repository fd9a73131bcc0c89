"""The in-process vLLM engine checks in a fresh interpreter: the step loop
(tests/inproc_vllm_engine_step.py) and Qwen3-Omni's thinker on vLLM against transformers
(tests/inproc_vllm_omni_thinker.py).

vLLM 0.32 registers kernel overrides through torch.library when an engine starts in-process;
after other tests in the same pytest process have loaded transformers' kernel hooks, that
registration fails ("'_lib_fn_wrapper' object has no attribute 'get'"). A stage worker is always
a fresh process, so the checks run in one too.

torch.compile is off in that interpreter (TORCHDYNAMO_DISABLE): the only compiled function these
checks reach is vLLM's sampler counting a sampled token's logprob rank (the thinker check asks for
logprobs; omni-pd's stages never do), and compiling it cold costs ~30 s of CI time for integers
that eager mode counts the same.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_required import require_vllm

require_vllm()
pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("script", ["inproc_vllm_engine_step.py", "inproc_vllm_omni_thinker.py"])
def test_vllm_engine_step_checks_in_a_fresh_interpreter(script):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-o",
            "python_files=inproc_*.py",
            str(HERE / script),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parent,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    print(result.stdout[-4000:], result.stderr[-2000:])
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.strip().splitlines()[-1]
