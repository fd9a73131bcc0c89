"""Validate a `stage_args` document (vllm-omni's legacy format) into a `PipelineConfig`, or
raise one `ConfigError` listing every problem.

Stages are validated one by one so a typo in one stage does not hide problems in another; the
cross-stage checks then run on the stages that validated.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from omni_pd.config.aliases import apply_processor_aliases
from omni_pd.config.checks import CheckContext, run_checks
from omni_pd.config.errors import ConfigError, ConfigIssue
from omni_pd.config.pydantic_issues import issues_from_validation_error
from omni_pd.config.schema import PipelineConfig, PipelineRuntime, StageConfig


def pipeline_config_from_dict(
    data: Mapping[str, Any], *, file: str = "<dict>", check_imports: bool = True
) -> PipelineConfig:
    """Validate an already-parsed stage config (same rules and errors as `load_pipeline_config`)."""
    data = apply_processor_aliases(data)  # vllm-omni's processor names -> omni-pd's
    issues: list[ConfigIssue] = []
    raw_stages = data.get("stage_args")
    valid: list[tuple[int, StageConfig]] = []
    ids_seen: dict[int, int] = {}

    if not isinstance(raw_stages, list) or not raw_stages:
        message = "stage_args is missing or empty" if not raw_stages else "stage_args must be a list"
        issues.append(
            ConfigIssue(file, None, "stage_args", raw_stages, "a non-empty list of stage mappings", message)
        )
        raw_stages = []
    for index, raw in enumerate(raw_stages):
        if not isinstance(raw, Mapping):
            issues.append(
                ConfigIssue(
                    file,
                    None,
                    f"stage_args[{index}]",
                    raw,
                    "a mapping with stage_id, engine_args, ...",
                    "stage entry is not a mapping",
                )
            )
            continue
        stage_id = raw.get("stage_id") if _is_int(raw.get("stage_id")) else None
        if stage_id is not None:
            if stage_id in ids_seen:
                issues.append(
                    ConfigIssue(
                        file,
                        stage_id,
                        f"stage_args[{index}].stage_id",
                        stage_id,
                        "a stage_id no other stage uses",
                        f"duplicate stage_id; stage_args[{ids_seen[stage_id]}] already uses {stage_id}",
                    )
                )
            else:
                ids_seen[stage_id] = index
        try:
            valid.append((index, StageConfig.model_validate(dict(raw))))
        except ValidationError as exc:
            issues.extend(
                issues_from_validation_error(exc, StageConfig, file, stage_id, ("stage_args", index))
            )

    # Validate the top level with the good stages only; stage problems are already reported.
    top = {**data, "stage_args": [stage for _, stage in valid]}
    cfg: PipelineConfig | None = None
    try:
        cfg = PipelineConfig.model_validate(top)
    except ValidationError as exc:
        top_issues = issues_from_validation_error(exc, PipelineConfig, file)
        issues.extend(i for i in top_issues if not i.key.startswith("stage_args"))

    runtime, runtime_valid = _runtime_section(data, cfg)
    ctx = CheckContext(
        file=file,
        stages=valid,
        known_ids=frozenset(ids_seen),
        runtime=runtime,
        complete=len(valid) == len(raw_stages) and bool(raw_stages),
        runtime_valid=runtime_valid,
    )
    issues.extend(run_checks(ctx, imports=check_imports))
    if issues:
        raise ConfigError(issues)
    assert cfg is not None  # no issues means the top level validated
    return cfg


def _runtime_section(
    data: Mapping[str, Any], cfg: PipelineConfig | None
) -> tuple[PipelineRuntime | None, bool]:
    """The top-level runtime for cross-checks, even when another top-level key was invalid."""
    if cfg is not None:
        return cfg.runtime, True
    if data.get("runtime") is None:
        return None, True
    try:
        return PipelineRuntime.model_validate(data["runtime"]), True
    except ValidationError:
        return None, False  # already reported by the top-level validation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
