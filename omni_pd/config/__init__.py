"""Stage YAML schema and loader: every error names file, stage, key and what to change."""

from omni_pd.config.deploy import load_deploy_config
from omni_pd.config.errors import ConfigError, ConfigIssue
from omni_pd.config.loader import load_pipeline_config
from omni_pd.config.stage_args import pipeline_config_from_dict
from omni_pd.config.schema import (
    ConnectorSpec,
    EdgeConfig,
    EdgeDefaults,
    EngineArgsConfig,
    KVConnectorExtraConfig,
    KVTransferConfig,
    PipelineConfig,
    PipelineRuntime,
    StageConfig,
    StageRuntime,
)

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "ConnectorSpec",
    "EdgeConfig",
    "EdgeDefaults",
    "EngineArgsConfig",
    "KVConnectorExtraConfig",
    "KVTransferConfig",
    "PipelineConfig",
    "PipelineRuntime",
    "StageConfig",
    "StageRuntime",
    "load_deploy_config",
    "load_pipeline_config",
    "pipeline_config_from_dict",
]
