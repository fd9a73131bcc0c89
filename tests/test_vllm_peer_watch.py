"""The consumer_peer_watch fix's liveness probe (omni_pd/engines/vllm/patches/consumer_peer_watch.py)
against real local sockets: a prefill engine counts as gone only when nothing listens on its
bootstrap port or another engine answers there; one that does not answer (frozen) is not.
No vLLM needed."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx")

from omni_pd.engines.vllm.patches.consumer_peer_watch import producer_gone  # noqa: E402


def _bootstrap(engine_id: str):
    """A stand-in for vLLM's Mooncake bootstrap server answering /query for one engine."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"0": {"engine_id": engine_id, "worker_addr": {}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _probe(port: int, engine_id: str, timeout_s: float = 0.5):
    return asyncio.run(producer_gone(f"http://127.0.0.1:{port}", engine_id, timeout_s))


def test_the_engine_that_answers_is_alive():
    server = _bootstrap("prefill-123")
    try:
        assert _probe(server.server_address[1], "prefill-123") is None
    finally:
        server.shutdown()


def test_another_engine_on_the_port_means_the_old_one_is_gone():
    server = _bootstrap("prefill-456")  # a restarted worker on a pinned port
    try:
        why = _probe(server.server_address[1], "prefill-123")
    finally:
        server.shutdown()
    assert why is not None and "prefill-456" in why and "prefill-123" in why


def test_nothing_listening_means_gone():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    why = _probe(port, "prefill-123")
    assert why is not None and "refuses connections" in why


def test_a_frozen_engine_is_not_taken_for_dead():
    """A listening socket that never answers (the kernel accepts for a SIGSTOPped process): the
    probe gives up after its timeout and reports nothing, so the receive keeps its blocks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        began = time.monotonic()
        assert _probe(sock.getsockname()[1], "prefill-123", timeout_s=0.3) is None
        assert time.monotonic() - began < 2.0
