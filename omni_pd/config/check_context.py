"""What every config check reads: the stages that passed schema validation, the ids the file
names and its runtime section (`CheckContext`), and how a check names a stage's key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_pd.config.errors import ConfigIssue
from omni_pd.config.schema import PipelineRuntime, StageConfig


@dataclass(frozen=True)
class CheckContext:
    file: str
    stages: list[tuple[int, StageConfig]]  # (index in stage_args, stage) for valid stages
    known_ids: frozenset[int]  # every stage_id written in the file, valid stage or not
    runtime: PipelineRuntime | None
    complete: bool  # every stage passed schema validation
    runtime_valid: bool = True  # top-level `runtime` passed schema validation
    # The model a stage that names none runs (known when the orchestrator starts, not at load).
    model: str | None = None

    def issue(
        self, stage: StageConfig | None, key: str, got: Any, allowed: str | None, message: str
    ) -> ConfigIssue:
        sid = None if stage is None else stage.stage_id
        return ConfigIssue(self.file, sid, key, got, allowed, message)


def stage_key(index: int, rest: str) -> str:
    return f"stage_args[{index}].{rest}"
