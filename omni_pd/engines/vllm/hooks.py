"""What a model package adds to the generic vLLM engine (`engines/vllm/engine.py`).

The base class serves a text LLM: token ids in, a `TextOutput` out, no rows. A model whose
downstream stages need more than tokens (an omni thinker feeding a talker) subclasses it in its
own package and returns it from its `ModelSpec.vllm_hooks`. The engine calls it; it never runs
vLLM itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..types import TextOutput, TokenPrompt
from .rows import RequestRows


@dataclass(frozen=True)
class LegRole:
    """Which part of a request's text generation this stage runs."""

    computes_prompt: bool  # False: a decode leg whose prompt KV comes from its prefill leg
    decodes: bool  # False: a prefill leg (one token, then its KV goes to the decode leg)
    rows: bool = True  # False: no later stage reads the rows (a text-only request): none recorded


class VllmModelHooks:
    # The model class (the model package's `ModelSpec.vllm_model_classes`, registered in vLLM by
    # omni-pd's plugin) records per-token rows (engines/vllm/rows.py) for `output` and `chunk`.
    records_rows: bool = False
    # Prompts with multimodal inputs are taken (the orchestrator refuses them up front if not).
    takes_multimodal_prompts: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """EngineArgs this model needs, over the stage's own (a stage that sets one of them to
        another value is refused by name)."""
        return {}

    def check_prompt(self, stage_id: int, prompt: TokenPrompt) -> None:
        """Raise ValueError, naming what to change, for a prompt this engine cannot take."""
        if prompt.has_multimodal_inputs():
            raise ValueError(
                f"stage {stage_id}: the vLLM text engine takes token ids only, not multimodal inputs"
            )

    def vllm_prompt(self, prompt: TokenPrompt) -> dict[str, Any]:
        """The prompt as vLLM's `LLMEngine.add_request` takes it."""
        return {"prompt_token_ids": list(prompt.prompt_token_ids)}

    def handoff_state(self, prompt_token_ids: list[int]) -> dict[str, int]:
        """What a decode engine that is not vLLM needs from this prefill leg besides the KV and
        the first token (the hf runner's `handoff_keys`); none for a text LLM."""
        return {}

    def output(self, text: TextOutput, rows: RequestRows, role: LegRole) -> Any:
        """The stage's output record for a finished request."""
        return text

    def chunk(
        self,
        prompt_token_ids: list[int],
        new_token_ids: list[int],
        rows: RequestRows,
        rows_from: int,
        role: LegRole,
        first: bool,
    ) -> tuple[Any, int] | None:
        """A streamed request's chunk for a downstream stage that runs alongside, and the
        position its rows reach; None: this model streams tokens only."""
        return None
