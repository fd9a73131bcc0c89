"""The bootstrap endpoint of vLLM 0.32's MooncakeConnector, served by a producer that is not vLLM.

A vLLM decode engine (`kv_role: kv_consumer`) learns where a producer's worker listens from
`GET <remote_bootstrap_addr>/query`, answered by vLLM's `MooncakeBootstrapServer` as
`{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: "tcp://host:port"}}}}`
(`mooncake_utils.py`; the consumer reads `engine_id` and the rank maps, `int()`-ing their keys).
`BootstrapServer` answers the same shape for one engine with one worker (dp 0, tp 0, pp 0); the
port is the OS's pick, so two engines on one host never collide.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)


def query_answer(engine_id: str, worker_addr: str) -> dict[str, dict]:
    """What vLLM's bootstrap server answers to /query for one engine of one worker."""
    return {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": worker_addr}}}}


class BootstrapServer:
    def __init__(self, host: str, engine_id: str, worker_addr: str):
        body = json.dumps(query_answer(engine_id, worker_addr)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/query":
                    self.send_error(404, f"{self.path}: this bootstrap server answers /query only")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
                log.debug("bootstrap %s: " + format, self.address_string(), *args)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.address = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="vllm-bootstrap", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
