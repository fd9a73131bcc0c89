"""A live omni-pd server process on loopback for the end-to-end tests, with an `openai` client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

MODEL = "tiny-qwen3-omni"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)  # polling a condition under a deadline
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def omni_pd_serve_command(port: int, model: str | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "omni_pd.entrypoints.cli",
        "--log-level",
        "INFO",
        "serve",
        model or MODEL,
        "--port",
        str(port),
        "--enable-debug-endpoints",
        "--request-timeout",
        "120",
    ]


class Server:
    """Starts `command(port)` (default: `omni-pd serve` on the tiny P/D config) and waits until
    GET /health answers 200."""

    def __init__(
        self, command=omni_pd_serve_command, env: dict[str, str] | None = None, api_key: str | None = None
    ):
        """`api_key`: started with OMNI_PD_API_KEY set to it; `client` and `headers` send it."""
        self.port = free_port()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = {**(env or {}), **({"OMNI_PD_API_KEY": api_key} if api_key else {})}
        self.base = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix=f"omni-pd-server-{self.port}-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(
            command(self.port),
            stdout=self.log,
            stderr=self.log,
            env={
                **{k: v for k, v in os.environ.items() if k != "OMNI_PD_API_KEY"},
                "MC_LOG_LEVEL": "ERROR",
                **env,
            },
        )

        def healthy():
            try:
                return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                assert self.proc.poll() is None, f"the server exited during start-up:\n{self.log_text()}"
                return False

        try:
            wait_for(healthy, 180, "GET /health to answer 200")
        except BaseException:
            self.stop()
            raise
        self.client = openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=api_key or "unused", max_retries=0, timeout=120
        )

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path) as handle:
            return handle.read()

    def state(self):
        return httpx.get(f"{self.base}/debug/state", timeout=30).json()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        if not self.log.closed:
            self.log.close()
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)
