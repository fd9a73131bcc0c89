"""`omni-pd` exits without the interpreter's teardown (entrypoints/cli.py `exit_process`), and
still does what an exit does: its status, the other threads' ends, the exit handlers, the output."""

import subprocess
import sys

_EXIT = """
import atexit, sys, threading
from omni_pd.entrypoints.cli import exit_process
atexit.register(lambda: print("exit handler ran", flush=False))
held = threading.Lock()
held.acquire()
def late():
    with held:  # still to write when the command is done
        print("thread finished", flush=False)
threading.Thread(target=late).start()
print("buffered", end="", flush=False)
sys.stderr.write("to stderr")
held.release()
exit_process(3)
print("not reached")
"""


def test_the_status_threads_exit_handlers_and_buffered_output_all_survive():
    result = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert result.stdout == "bufferedthread finished\nexit handler ran\n"
    assert result.stderr == "to stderr"


def test_the_console_script_and_python_m_exit_through_it():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "omni-pd"]
    assert script.value == "omni_pd.entrypoints.cli:entry"
    result = subprocess.run(
        [sys.executable, "-m", "omni_pd.entrypoints.cli", "validate-config", "/nonexistent.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "nonexistent.yaml" in result.stderr
