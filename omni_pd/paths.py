"""Where the shipped stage configs live (the repository's `stage_configs/`)."""

from __future__ import annotations

from pathlib import Path

STAGE_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "stage_configs"
DEFAULT_STAGE_CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"


def default_stage_config() -> Path:
    if not DEFAULT_STAGE_CONFIG.is_file():
        raise FileNotFoundError(
            f"the default stage config {DEFAULT_STAGE_CONFIG} is missing; "
            "pass --stage-configs-path (stage_configs_path=...) explicitly"
        )
    return DEFAULT_STAGE_CONFIG
