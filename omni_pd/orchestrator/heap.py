"""Keep Python's cyclic garbage collector off the model and library objects loaded at start-up.

A stage worker or a server holds some 400 thousand Python objects once torch, transformers and
the model are loaded. Every full (oldest-generation) collection walks all of them: measured in the
server process at concurrency 16, one took 220 ms, during which its event loop served nobody.
Objects alive at the end of start-up live as long as the process, so they are moved to the
permanent generation (`gc.freeze`), as vLLM does in its server and engine processes; collections
then walk only what requests allocate. Only for processes omni-pd owns: a library user's process
keeps its collector as it is.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%s: %d start-up objects frozen out of garbage collection", who, frozen)
    return frozen
