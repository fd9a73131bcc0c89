"""Stage order from `engine_input_source` (the config layer has already rejected cycles)."""

from __future__ import annotations


def topological_order(sources: dict[int, tuple[int, ...]]) -> list[int]:
    order: list[int] = []
    placed: set[int] = set()
    pending = sorted(sources)
    while pending:
        ready = [s for s in pending if all(src in placed for src in sources[s])]
        if not ready:
            raise ValueError(f"stages {pending} wait on each other through engine_input_source")
        for stage in ready:
            order.append(stage)
            placed.add(stage)
        pending = [s for s in pending if s not in placed]
    return order
