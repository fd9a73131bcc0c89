"""Load a stage YAML into a `PipelineConfig`: a legacy `stage_args` file or a vllm-omni 0.30
deploy file, told apart by their keys. Either way one `ConfigError` lists every problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omni_pd.config.deploy import load_deploy_config
from omni_pd.config.schema import PipelineConfig
from omni_pd.config.stage_args import pipeline_config_from_dict
from omni_pd.config.yaml_io import read_yaml_mapping


def load_pipeline_config(
    path: str | Path, *, check_imports: bool = True, platform: str | None = None
) -> PipelineConfig:
    """Read and validate a stage YAML: vllm-omni's legacy `stage_args` file, or a vllm-omni 0.30
    deploy file (a top-level `stages` list, see `omni_pd.config.deploy`; `platform` picks its
    `platforms:` section, default: the machine's). `check_imports=False` skips importing input
    processors."""
    file = str(path)
    data = read_yaml_mapping(Path(path), file)
    if is_deploy_document(data):
        return load_deploy_config(path, platform=platform, check_imports=check_imports)
    return pipeline_config_from_dict(data, file=file, check_imports=check_imports)


def is_deploy_document(data: Mapping[str, Any]) -> bool:
    """A vllm-omni 0.30 deploy file (`stages`, `base_config`), not a legacy `stage_args` one."""
    return "stage_args" not in data and ("stages" in data or "base_config" in data)
