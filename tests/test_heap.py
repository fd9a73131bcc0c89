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


def test_a_worker_freezes_before_it_says_ready(monkeypatch):
    """The collection takes a few hundred ms in a real worker: done after Ready, the first
    request waited for it (first audio 36 -> 460 ms on a fresh process)."""
    from omni_pd.orchestrator import engine_factory, messages, worker

    class Engine:
        def describe(self):
            return {}

    class Conn:
        frozen_at_ready = None

        def send_bytes(self, data):
            if isinstance(messages.loads(data), messages.Ready):
                Conn.frozen_at_ready = gc.get_freeze_count()

    class Stage:
        stage_id = 7

        class runtime:  # what the worker reads of the stage config before building
            env: dict = {}

    monkeypatch.setattr(engine_factory, "build_engine", lambda stage, model: Engine())
    gc.unfreeze()
    try:
        assert worker._build(Stage(), "m", Conn(), freeze=True) is not None
        assert Conn.frozen_at_ready and Conn.frozen_at_ready > 0
        gc.unfreeze()
        worker._build(Stage(), "m", Conn(), freeze=False)  # control: an in-process stage's thread
        assert Conn.frozen_at_ready == 0
    finally:
        gc.unfreeze()
