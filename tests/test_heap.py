"""The start-up heap of an omni-pd process is frozen out of the garbage collector."""
import gc

from omni_pd.orchestrator.heap import freeze_startup_heap


def test_objects_alive_at_startup_leave_the_collectors_generations():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0  # control: nothing frozen before
    kept = [object() for _ in range(1000)]
    try:
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert gc.get_count()[0] < len(kept)  # what was young is now permanent
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
