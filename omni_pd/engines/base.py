"""The one interface every stage engine offers the orchestrator, and what a stage input
processor receives."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams


@dataclass
class StageInputs:
    """What a `custom_process_input_func` gets to build a stage's prompt."""

    request_id: str
    stage_id: int
    source_stage_ids: tuple[int, ...]
    # Outputs of every stage that has finished for this request, by stage id: a P/D merge needs
    # the prefill leg's output even though only the decode leg feeds the next stage.
    upstream: dict[int, Any]
    model_config: Any  # the model's top-level (HF) config
    speaker: str = "ethan"
    extras: dict[str, Any] = field(default_factory=dict)


class StageEngine(ABC):
    """Runs one stage for one request at a time."""

    stage_id: int

    @abstractmethod
    def generate(self, request_id: str, prompt: Any, params: SamplingParams) -> Any:
        """Run the stage on a prompt built for it; return the stage's output record."""

    def close(self) -> None:
        """Release what the engine holds (models, registered memory, sockets)."""

    def debug_state_counts(self) -> dict[str, int]:
        """Per-request state this engine holds; all zero between requests."""
        return {}
