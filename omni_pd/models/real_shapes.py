"""What every real-shape config shares: the published stacks cut to `--layers` (no torch here)."""

from __future__ import annotations


def cut_stacks(published: dict[str, int], layers: int) -> dict[str, int]:
    """Each stack's layers when cut to `layers` (a stack with fewer keeps them all); ValueError
    for a count that is not a whole number from 1 to the deepest stack's."""
    deepest = max(published.values())
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= deepest:
        raise ValueError(
            f"--layers must be a whole number from 1 to {deepest} (the deepest published stack's "
            f"layers; each stack is cut to it), not {layers!r}"
        )
    return {stack: min(layers, count) for stack, count in published.items()}
