"""Per-token rows out of a vLLM model, per request and per step: what a downstream stage needs
besides tokens (an omni thinker's layer-0 embeddings and accept-layer hidden states).

vLLM returns tokens to its caller, not hidden states. Two of its extension points carry them out
instead, and both work with the CPU model runner and the GPU one (V1):
- the model class (a model package registers a subclass of vLLM's model for the checkpoint's
  architecture) computes its rows in `forward` and hands them to the `RowSink` attached to it;
- `RowCaptureExtension`, mixed into vLLM's worker through `worker_extension_cls`, attaches that
  sink and gives the rows back through `LLMEngine.collective_rpc`, once per step.

The sink reads which request each row belongs to from the runner's input batch at the moment
the model runs (`input_batch.req_ids`, `query_start_loc`, `num_computed_tokens_cpu`: the state
`execute_model` prepared for that forward pass), so rows are keyed by vLLM's request id and
placed by absolute position. A dummy or profiling pass (no request scheduled) records nothing.

On GPUs a full CUDA graph replays without running `forward` in Python: run such a stage with
`enforce_eager` or piecewise graphs (the outer model forward is not captured in those).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

SINK_ATTRIBUTE = "omni_pd_row_sink"
# In a request's SamplingParams.extra_args: False, no later stage reads its rows (a text-only
# request), so the sink records none for it.
ROWS_ARG = "omni_pd_rows"
EXTENSION = "omni_pd.engines.vllm.rows.RowCaptureExtension"
# The sink reads the V1 model runner's input batch, and the model classes that feed it build on
# vLLM's EAGLE-3 auxiliary outputs: internals written against, and tested on, these releases.
SUPPORTED_VLLM = ("0.32.0",)


def check_vllm_version(version: str | None = None) -> None:
    """Refuse, naming both, a vLLM this row recording was not written for."""
    from .patches._guard import base_version, vllm_version

    version = version or vllm_version()
    if base_version(version) not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"omni-pd records a vLLM model's per-token rows (the embeddings and hidden states an "
            f"omni model's next stage reads) through vLLM internals written for vLLM "
            f"{', '.join(SUPPORTED_VLLM)}, but vLLM {version} is installed: install a supported "
            "vLLM (`pip install 'omni-pd[vllm]'`), or port omni_pd/engines/vllm/rows.py"
        )


class RowSink:
    """Where a model's `forward` puts its rows ([tokens, ...] tensors, in the pass's order)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._rows: dict[str, list[tuple[int, tuple[torch.Tensor, ...]]]] = defaultdict(list)

    def record(self, *tensors: torch.Tensor) -> None:
        batch = self._runner.input_batch
        ids = list(batch.req_ids)
        if not ids:
            return
        bounds = self._runner.query_start_loc.np
        total = int(bounds[len(ids)])
        if any(t.shape[0] < total for t in tensors):
            raise RuntimeError(
                f"the model recorded {[t.shape[0] for t in tensors]} rows for a pass "
                f"of {total} scheduled tokens"
            )
        for i, request_id in enumerate(ids):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi > lo and self._wanted(request_id):
                start = int(batch.num_computed_tokens_cpu[i])
                self._rows[request_id].append(
                    (start, tuple(t[lo:hi].detach().to("cpu", copy=True) for t in tensors))
                )

    def _wanted(self, request_id: str) -> bool:
        state = self._runner.requests.get(request_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        return extra.get(ROWS_ARG, True) is not False

    def take(self) -> dict[str, list[tuple[int, tuple[torch.Tensor, ...]]]]:
        rows, self._rows = dict(self._rows), defaultdict(list)
        return rows


class RowCaptureExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); called by name through
    `collective_rpc`, so no callable crosses a process boundary."""

    # Set by the vLLM worker this is mixed into (its V1 model runner); declared for the type
    # checker only, since vLLM is optional here.
    model_runner: Any

    def omni_pd_attach_rows(self) -> bool:
        model = self.model_runner.get_model()
        if not hasattr(model, SINK_ATTRIBUTE):
            raise TypeError(
                f"{type(model).__name__} does not record rows: its model package must "
                f"register a model class with a {SINK_ATTRIBUTE!r} attribute"
            )
        setattr(model, SINK_ATTRIBUTE, RowSink(self.model_runner))
        return True

    def omni_pd_take_rows(self) -> dict[str, list[tuple[int, tuple[torch.Tensor, ...]]]]:
        return getattr(self.model_runner.get_model(), SINK_ATTRIBUTE).take()


@dataclass
class RequestRows:
    """One request's rows by absolute position; a position computed again (a decode leg
    recomputing the last prompt token, a preempted request recomputed) keeps its latest rows."""

    rows: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def add(self, start: int, tensors: tuple[torch.Tensor, ...]) -> None:
        for offset in range(tensors[0].shape[0]):
            self.rows[start + offset] = tuple(t[offset] for t in tensors)

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, ...] | None:
        """Rows lo .. hi-1 stacked per tensor; None when any is missing."""
        if hi <= lo:
            return None
        if any(p not in self.rows for p in range(lo, hi)):
            return None
        picked = [self.rows[p] for p in range(lo, hi)]
        return tuple(torch.stack(column) for column in zip(*picked))

    def __len__(self) -> int:
        return len(self.rows)
