"""One `omni-pd serve` subprocess on a free loopback port, for the length of a `with` block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or did not answer GET /health with 200 in time; the message ends with
    the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def health_status(base_url: str, timeout_s: float = 2.0) -> int | None:
    """The status code of GET {base_url}/health, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:  # 503 while the stages start
        return exc.code
    except (OSError, ValueError):
        return None


def tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of a server log, leaving out the access-log lines of our own
    GET /health polling."""
    try:
        with open(path, errors="replace") as handle:
            kept = [line for line in handle if '"GET /health ' not in line]
    except OSError:
        return ""
    return "".join(kept[-lines:])


class ServerProcess:
    """`python -m omni_pd.entrypoints.cli serve MODEL --stage-configs-path CONFIG` on 127.0.0.1.

    The environment is inherited, with MC_LOG_LEVEL=ERROR unless set, then `env` on top. The log
    goes to a temp file, removed on a clean stop and kept (and named in errors) otherwise."""

    def __init__(
        self,
        model: str,
        config: str | Path,
        *,
        request_timeout_s: float,
        startup_timeout_s: float,
        env: dict[str, str] | None = None,
        log_level: str = "INFO",
        serve_args: Sequence[str] = (),
    ) -> None:
        """`serve_args`: more `omni-pd serve` options (e.g. --max-queued-requests 8)."""
        self.model, self.config = model, str(config)
        self.request_timeout_s, self.startup_timeout_s = request_timeout_s, startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.log_level = log_level
        self.serve_args = list(serve_args)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self._keep_log = False

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            self.log_level,
            "serve",
            self.model,
            "--stage-configs-path",
            self.config,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--request-timeout",
            f"{self.request_timeout_s:g}",
            *self.serve_args,
        ]

    def start(self) -> "ServerProcess":
        self.port = free_port()
        fd, self.log_path = tempfile.mkstemp(prefix=f"omni-pd-bench-server-{self.port}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )
        try:
            failure = self._wait_healthy()
        except BaseException:  # Ctrl-C while waiting
            self._keep_log = True
            self.stop()
            raise
        if failure:
            self._keep_log = True
            self.stop()  # first, so that the log holds the shutdown too
            last = tail(self.log_path)
            raise ServerStartError(
                f"{failure} ({self.config}); log {self.log_path}, "
                + (f"its last lines:\n{last}" if last.strip() else "empty")
            )
        return self

    def _wait_healthy(self) -> str | None:
        """None once GET /health answers 200, else what went wrong."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                return f"the server exited with {self.proc.returncode} during start-up"
            if health_status(self.base_url) == 200:
                return None
            if time.monotonic() >= deadline:
                return f"GET /health did not answer 200 within {self.startup_timeout_s:g} s"
            time.sleep(0.25)  # polling /health under a deadline

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit in `timeout_s`. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._keep_log = True
                self.proc.kill()
                self.proc.wait(30)
        if self.proc.returncode not in (0, -signal.SIGTERM):
            self._keep_log = True
        if self.log_path and not self._keep_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
