"""Routing a request: which stages it walks (along the stage graph's edges, in streamed groups)
and which replica of each stage serves it (picked by load at first use, kept for the request,
swapped for one that is up where the one picked has gone away)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from ..config.schema import StageConfig
from .replicas import StagePool
from .request_state import RequestState
from .stage_client import StageClient

log = logging.getLogger(__name__)


def stages_for(
    modalities: frozenset[str], order: list[int], stages: Mapping[int, StageConfig], text_stage_id: int
) -> list[int]:
    """The stages a request needs: up to the text stage for text alone, all for audio."""
    if "audio" in modalities:
        return list(order)
    needed, todo = set(), [text_stage_id]
    while todo:
        stage_id = todo.pop()
        if stage_id not in needed:
            needed.add(stage_id)
            todo.extend(stages[stage_id].engine_input_source)
    return [s for s in order if s in needed]


def streamed_groups(
    stage_ids: list[int], stages: Mapping[int, StageConfig], stream_processors: Mapping[int, Callable]
) -> list[list[int]]:
    """Consecutive stages joined by streamed edges run as one group, all at once."""
    groups: list[list[int]] = []
    for stage_id in stage_ids:
        if (
            groups
            and stage_id in stream_processors
            and stages[stage_id].engine_input_source == (groups[-1][-1],)
        ):
            groups[-1].append(stage_id)
        else:
            groups.append([stage_id])
    return groups


class Router:
    """Each request's replica of every stage, over the stage pools (which it reads, never owns:
    they are filled as the workers start and emptied as they stop)."""

    def __init__(
        self, stages: Mapping[int, StageConfig], pools: dict[int, StagePool], text_model_stage: str
    ) -> None:
        self.stages, self.pools, self.text_model_stage = stages, pools, text_model_stage

    def footprint(self, state: RequestState, stage_id: int) -> tuple[int, int]:
        """(prompt tokens, KV positions) the request brings to a stage, for the router: the
        text stage's prompt on a thinker replica, nothing it weighs elsewhere."""
        if self.stages[stage_id].model_stage != self.text_model_stage:
            return 0, 0
        return state.prompt_len, state.prompt_len + state.params[stage_id].max_tokens

    def route(self, state: RequestState, stage_id: int) -> StageClient:
        """The replica of `stage_id` that serves this request, picked by load at first use."""
        assignment = state.replicas.get(stage_id)
        if assignment is None:
            assignment = self.pools[stage_id].pick(*self.footprint(state, stage_id))
            state.replicas[stage_id] = assignment
            self.log_route(state, stage_id)
        return assignment.client

    def log_route(self, state: RequestState, stage_id: int) -> None:
        pool, k = self.pools[stage_id], state.replicas[stage_id].index
        if len(pool) > 1:
            log.debug("request %s: %s (%s)", state.request_id, pool.clients[k].name, pool.describe_load(k))

    async def usable_replica(self, state: RequestState, stage_id: int, deadline: float) -> None:
        """Wait (within the deadline) until the request's replica of `stage_id` can take it. A
        replica picked earlier (the decode replica, at the prefill leg) that has gone away since
        is swapped for one that is up: any decode replica can pull the KV."""
        pool = self.pools[stage_id]
        assignment = state.replicas.get(stage_id)
        if (
            assignment is not None
            and len(pool) > 1
            and assignment.client.unavailable() is not None
            and pool.usable()
        ):
            assignment.release()
            del state.replicas[stage_id]
            assignment = None
        if assignment is None:
            await pool.wait_usable(deadline - time.monotonic())
            self.route(state, stage_id)
        else:
            await assignment.client.wait_usable(deadline - time.monotonic())
