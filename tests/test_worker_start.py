"""Stage workers fork from a server that preloaded torch and the models (orchestrator/
worker_start.py), and still behave as spawned ones: they write to the orchestrator's stdout and
stderr as they are when the worker starts, and a bad start method is refused by name."""

import os

import pytest

from omni_pd.orchestrator import worker_start
from omni_pd.orchestrator.worker_start import ParentStdio, worker_context


def _write(stdio, conn, install: bool) -> None:
    if install:
        stdio.install()
    os.write(2, f"worker {os.getpid()} writes here\n".encode())
    conn.send(os.getpid())
    conn.close()


def _run(install: bool) -> int:
    context = worker_context()
    parent, child = context.Pipe()
    process = context.Process(target=_write, args=(ParentStdio(), child, install))
    process.start()
    child.close()
    pid = parent.recv()
    process.join(30)
    return pid


@pytest.fixture(scope="module", autouse=True)
def server_started_before_the_capture():
    """The server starts before a test's capture swaps fd 2, as it does in a long-lived
    orchestrator whose stderr is redirected later."""
    _run(install=True)


def test_workers_start_from_the_preloading_server():
    assert worker_context().get_start_method() == "forkserver"
    assert "omni_pd.orchestrator.worker" in worker_start.preload_modules()


def test_a_worker_writes_to_the_stderr_its_orchestrator_has_now(capfd):
    pid = _run(install=True)
    assert f"worker {pid} writes here" in capfd.readouterr().err


def test_negative_control_without_the_parents_stdio_the_write_goes_elsewhere(capfd):
    pid = _run(install=False)
    assert f"worker {pid} writes here" not in capfd.readouterr().err


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(worker_start, "_context", None)
    monkeypatch.setenv("OMNI_PD_WORKER_START", "fork")
    with pytest.raises(ValueError, match=r"OMNI_PD_WORKER_START='fork': use one of forkserver, spawn"):
        worker_context()
