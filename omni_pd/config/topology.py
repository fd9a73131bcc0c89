"""A model's built-in pipeline topology: what a vllm-omni 0.30 deploy file does not say.

vllm-omni 0.30 splits a stage config in two: the model's pipeline (stage roles, inputs, input
processors, outputs) lives in code, and the deploy YAML carries only deployment knobs (devices,
batch sizes, sampling defaults, connectors) keyed by `stage_id`. omni-pd keeps the same split:
a model package describes its pipelines with these types (see
`omni_pd.models.qwen3_omni.topology`) and `omni_pd.config.deploy` merges a deploy file onto one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping

PDRole = Literal["prefill", "decode"]


@dataclass(frozen=True)
class TopologyStage:
    stage_id: int
    model_stage: str  # "thinker", "talker", "code2wav"
    engine_output_type: str
    engine_input_source: tuple[int, ...] = ()
    custom_process_input_func: str | None = None
    hf_config_name: str | None = None
    final_output_type: str | None = None  # None: the stage's output is not a final output
    is_comprehension: bool = False
    role: PDRole | None = None  # the thinker's prefill or decode leg of a P/D pair
    # Used when the deploy file gives the stage no default_sampling_params at all.
    default_sampling_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def label(self) -> str:
        return f"{self.model_stage} {self.role}" if self.role else self.model_stage


@dataclass(frozen=True)
class Topology:
    name: str  # the deploy file's `pipeline:` key
    model_arch: str
    stages: tuple[TopologyStage, ...]

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(s.stage_id for s in self.stages)

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        return tuple((src, s.stage_id) for s in self.stages for src in s.engine_input_source)

    @property
    def has_pd(self) -> bool:
        return any(s.role is not None for s in self.stages)

    def stage(self, stage_id: int) -> TopologyStage | None:
        return next((s for s in self.stages if s.stage_id == stage_id), None)

    def describe(self) -> str:
        """ "0 thinker, 1 talker, 2 code2wav" for messages."""
        return ", ".join(f"{s.stage_id} {s.label}" for s in self.stages)
