"""vllm-omni's published wheels, fetched once with `pip download --no-deps` into .cache/ (never
copied into the repository): tests read vllm-omni's own config files from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "vllm-omni"


def vllm_omni_wheel(version: str) -> Path:
    """The wheel of vllm-omni `version`, downloaded (no dependencies) on first use."""
    found = sorted(CACHE.glob(f"vllm_omni-{version}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            f"vllm-omni=={version}",
            "-d",
            str(CACHE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = sorted(CACHE.glob(f"vllm_omni-{version}-*.whl"))
    assert result.returncode == 0 and found, (
        f"could not download vllm-omni=={version} from the package index (needed to test its "
        f"stage files):\n{result.stderr}"
    )
    return found[0]
