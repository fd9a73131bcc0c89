"""The one interface every stage engine offers the orchestrator, and what a stage input
processor receives."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

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
    def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                 on_token: Callable[[int], None] | None = None) -> Any:
        """Run the stage on a prompt built for it; return the stage's output record. A stage that
        produces text calls `on_token` with each token as it is sampled (it may raise to abort)."""

    # Engine calls the orchestrator may make outside the request path, by name.
    control_calls: frozenset[str] = frozenset({"debug_state_counts"})

    def close(self) -> None:
        """Release what the engine holds (models, registered memory, sockets)."""

    def describe(self) -> dict[str, Any]:
        """Facts the orchestrator logs and routes on (engine id, KV session, ...)."""
        return {}

    def housekeeping(self) -> None:
        """Periodic work between requests (expire KV leases)."""

    def debug_state_counts(self) -> dict[str, int]:
        """Per-request state this engine holds; all zero between requests."""
        return {}

    def control(self, name: str, **kwargs: Any) -> Any:
        if name not in self.control_calls:
            raise ValueError(f"stage {self.stage_id} has no control call {name!r}; "
                             f"it offers {sorted(self.control_calls)}")
        return getattr(self, name)(**kwargs)
