"""The batched pass, and the one-by-one pass when it fails: one helper for every batched step."""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


def each_alone(
    items: Sequence[T],
    batched: Callable[[Sequence[T]], list[R]],
    on_failure: Callable[[T, Exception], None],
    what: str,
) -> list[tuple[T, R]]:
    """`batched(items)` in one call; if it raises, each item alone (the batched pass computes an
    item's bits as it computes them alone), so that only the items that fail alone fail
    (`on_failure(item, exc)`). Returns (item, result) for the items that succeeded."""
    if not items:
        return []
    try:
        return list(zip(items, batched(items)))
    except Exception:  # noqa: BLE001 - retried one by one below
        log.debug("%s of %d failed as a batch; each runs alone", what, len(items), exc_info=True)
    done = []
    for item in items:
        try:
            [result] = batched([item])
        except Exception as exc:  # noqa: BLE001 - confined to this item
            log.debug("%s failed for one item: %s", what, exc, exc_info=True)
            on_failure(item, exc)
            continue
        done.append((item, result))
    return done
