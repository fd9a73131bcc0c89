"""Per-stage sampling parameters, named after vLLM's `SamplingParams` fields.

A frozen dataclass: P/D planning derives new objects with `dataclasses.replace`, so a caller's
parameters are never mutated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k filtering, as in vLLM
    max_tokens: int = 16
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # vLLM's kv_transfer_params: do_remote_prefill, do_remote_decode, transfer_id, ... (see planning)
    kv_transfer_params: dict[str, Any] | None = field(default=None, compare=True, hash=False)

    def __post_init__(self) -> None:
        # Accept lists from YAML / JSON but store tuples so the object stays immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.kv_transfer_params is not None:
            object.__setattr__(self, "kv_transfer_params", dict(self.kv_transfer_params))
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        unknown = set(values) - cls.field_names()
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {sorted(unknown)}; allowed: {sorted(cls.field_names())}"
            )
        return cls(**values)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
