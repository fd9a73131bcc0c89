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


_SERVER_PID = (
    "import os, sys, time\n"
    "from multiprocessing import forkserver\n"
    "from omni_pd.orchestrator.worker_start import start_server_early\n"
    "start_server_early()\n"
    "pid = forkserver._forkserver._forkserver_pid\n"
    "# the server may still be between fork and exec (its cmdline reads empty, or as this\n"
    "# script's 'python -'): wait until it has become the server\n"
    "deadline = time.monotonic() + 20\n"
    "cmdline = ''\n"
    "while pid is not None and 'forkserver' not in cmdline and time.monotonic() < deadline:\n"
    "    cmdline = open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ')\n"
    "print(pid if pid is None else cmdline)\n"
    "if pid is not None:\n"
    "    os.kill(pid, 9)  # not left importing for seconds after the test\n"
)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_the_server_can_start_before_the_first_worker(method):
    """`start_server_early` starts the preloading server at once (it imports while the
    orchestrator goes on); where workers spawn there is none to start."""
    import subprocess
    import sys

    env = {**os.environ, "OMNI_PD_WORKER_START": method}
    out = subprocess.run(
        # read from stdin, so that this script's text is not in a command line the test reads
        [sys.executable, "-"],
        input=_SERVER_PID,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout.strip()
    if method == "forkserver":
        assert "forkserver" in out and "omni_pd.orchestrator.worker" in out, out
    else:
        assert out == "None"


def test_the_orchestrator_starts_the_server_before_it_loads_the_models_side(monkeypatch):
    """Its imports overlap the orchestrator's own (the tokenizer, the input processors): the
    server is started once the config has loaded, before the pipeline loads."""
    from omni_pd.orchestrator import async_omni

    calls = []

    class Stop(Exception):
        pass

    def load_pipeline(self, model):
        calls.append("pipeline")
        raise Stop

    monkeypatch.setattr(async_omni, "start_server_early", lambda: calls.append("server"))
    monkeypatch.setattr(async_omni.AsyncOmni, "_load_pipeline", load_pipeline)
    with pytest.raises(Stop):
        async_omni.AsyncOmni()
    assert calls == ["server", "pipeline"]


_FAILED_START = (
    "import os\n"
    "from omni_pd.orchestrator import async_omni\n"
    "from omni_pd.registry import ModelNotFound\n"
    "started = []\n"
    "start = async_omni.start_server_early\n"
    "async_omni.start_server_early = lambda: started.append(start()) or started[-1]\n"
    "if os.environ.get('KEEP_SERVER'):  # the negative control: nothing stops it\n"
    "    async_omni.stop_early_server = lambda pid: None\n"
    "try:\n"
    "    async_omni.AsyncOmni('/nonexistent/model')\n"
    "except ModelNotFound:\n"
    "    pass\n"
    "pid = started[0]\n"
    "print(pid is not None, os.path.exists(f'/proc/{pid}'))\n"
    "if pid is not None:\n"
    "    try:\n"
    "        os.kill(pid, 9)\n"
    "    except ProcessLookupError:\n"
    "        pass\n"
)


@pytest.mark.parametrize("keep", [False, True], ids=["stopped", "control-kept"])
def test_a_start_up_that_fails_stops_the_server_it_started(keep):
    """An unknown model fails after the server started importing: it is stopped, not left
    running (and holding the caller's stdout) until its imports finish."""
    import subprocess
    import sys

    env = {**os.environ, "KEEP_SERVER": "1" if keep else ""}
    out = subprocess.run(
        [sys.executable, "-c", _FAILED_START], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True" if keep else "False"], out.stdout
