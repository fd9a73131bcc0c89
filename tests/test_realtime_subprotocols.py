"""The Realtime API's key as browsers must send it, as a websocket subprotocol
(realtime/subprotocols.py, checked by middleware.RequestGuard), in process against a scripted
orchestrator; the header and the 401 stay for other clients. The demo page uses it in a real
browser in e2e/test_demo_page.py."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect
from test_openai_stream_audio import ScriptedOmni

from omni_pd.entrypoints.openai.api_server import create_app

KEY = "sk-subprotocol-unit"
KEY_PROTOCOL = f"openai-insecure-api-key.{KEY}"


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(lambda: ScriptedOmni(), "m", api_key=KEY)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:  # the scripted stages start at once
            assert time.monotonic() < deadline, "the app never became healthy"
        yield client


def _first_event(ws) -> dict:
    return json.loads(ws.receive_text())


def test_a_browser_offers_the_key_as_a_subprotocol_and_gets_realtime_back(http):
    with http.websocket_connect("/v1/realtime?model=m", subprotocols=["realtime", KEY_PROTOCOL]) as ws:
        assert ws.accepted_subprotocol == "realtime"  # never the key entry
        event = _first_event(ws)
        assert event["type"] == "session.created" and "modalities" not in event["session"]


def test_the_beta_subprotocol_asks_for_the_beta_protocol(http):
    offered = ["realtime", KEY_PROTOCOL, "openai-beta.realtime-v1"]
    with http.websocket_connect("/v1/realtime", subprotocols=offered) as ws:
        assert "modalities" in _first_event(ws)["session"]  # the beta session's fields


@pytest.mark.parametrize(
    "offered",
    [
        ["realtime", "openai-insecure-api-key.wrong"],
        ["realtime", f"openai-insecure-api-key.{KEY}x"],
        ["realtime", "openai-insecure-api-key."],
        ["realtime"],
    ],
    ids=["wrong", "longer", "empty", "none"],
)
def test_a_wrong_key_is_refused_in_the_protocol(http, offered):
    """A browser cannot read a refused handshake's status: it gets an error event naming the
    problem and a close with 1008 (policy violation)."""
    with http.websocket_connect("/v1/realtime", subprotocols=offered) as ws:
        assert ws.accepted_subprotocol == "realtime"
        event = _first_event(ws)
        assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
        assert "openai-insecure-api-key.<key>" in event["error"]["message"]
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1008


def test_clients_without_subprotocols_keep_the_header_and_the_401(http):
    with http.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.accepted_subprotocol is None and _first_event(ws)["type"] == "session.created"
    with (
        pytest.raises(WebSocketDenialResponse) as denied,
        http.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer wrong"}),
    ):
        pass
    assert denied.value.status_code == 401
    assert denied.value.json()["error"]["code"] == "invalid_api_key"
