"""The one object that owns a request's state while it crosses the stages."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: Any  # the model pipeline's prompt object (`ModelPipeline.normalize_prompt`)
    params: dict[int, SamplingParams]  # per stage id
    started: float = field(default_factory=time.perf_counter)
    outputs: dict[int, Any] = field(default_factory=dict)
    stage_ms: dict[int, float] = field(default_factory=dict)
    first_token_at: float | None = None
    prompt_len: int = 0  # the text stage's prompt, in tokens (known once it is built)
    transfer_id: str | None = None  # the P/D handoff's key, once the prefill leg starts
    kv_released: bool = False
    # Push mode: the decode replica's reservation for the prefill leg to write into (its push
    # target), until the decode leg takes it or it is released.
    push_target: dict[str, Any] | None = None
    handoff_deadline: float = 0.0  # monotonic time by which the decode leg must have the KV
    local_prefill: bool = False  # the P/D fallback: the decode leg computes the prompt itself
    active_stages: set[int] = field(default_factory=set)  # stages working on it now, for aborts
    aborted: bool = False
    silent: bool = False  # the text stage's answer has nothing to speak: no audio stage runs
    # False: text only, no stage after the text stage reads its per-token rows (its legs too),
    # so its worker records none.
    text_rows: bool = True
    # When each stage started and ended, and when each audio chunk was handed on, in ms since
    # `started`: the request's timeline, reported in its metrics.
    stage_spans: dict[int, list[float]] = field(default_factory=dict)
    audio_chunk_ms: list[float] = field(default_factory=list)
    audio_pieces: list[Any] = field(default_factory=list)  # streamed audio, joined at the end
    # The request's one text stream to the client (token ids in, text deltas out), and how many
    # of the text stage's first tokens it has had already (P/D: the prefill leg's first token).
    text_stream: Any = None
    tokens_streamed_early: int = 0
    # The replica of each stage the request was routed to (`replicas.Assignment`); each counts
    # as its replica's load until released, at the stage's end or, at the latest, the request's.
    replicas: dict[int, Any] = field(default_factory=dict)
    # Hop stamps (hops.py): (where, hop) -> perf_counter, the first pass of each only.
    hops: dict[tuple[str, str], float] = field(default_factory=dict)

    def hop(self, where: str, hop: str) -> None:
        self.hops.setdefault((where, hop), time.perf_counter())

    def release_replicas(self) -> None:
        for assignment in self.replicas.values():
            assignment.release()

    def stage_started(self, stage_id: int) -> None:
        self.stage_spans[stage_id] = [self.elapsed_ms()]

    def stage_finished(self, stage_id: int, began: float, output: Any) -> None:
        """Its span ends now; `began` (perf_counter) starts the time it is charged with."""
        self.stage_spans[stage_id].append(self.elapsed_ms())
        self.stage_ms[stage_id] = self.elapsed_ms(began)
        self.outputs[stage_id] = output

    def elapsed_ms(self, since: float | None = None) -> float:
        return (time.perf_counter() - (since if since is not None else self.started)) * 1e3
