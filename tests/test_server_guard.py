"""`omni-pd serve --api-key / --max-request-bytes` and the middleware that enforces them, in
process around a stub app (the live server's tests are in e2e/test_server.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from omni_pd.entrypoints.cli import build_parser
from omni_pd.entrypoints.openai.middleware import RequestGuard
from omni_pd.entrypoints.openai.protocol import DEFAULT_MAX_REQUEST_BYTES


def test_serve_flags_and_the_api_key_environment_variable(monkeypatch):
    monkeypatch.delenv("OMNI_PD_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.api_key is None and args.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 16 << 20
    monkeypatch.setenv("OMNI_PD_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "flag", "--max-request-bytes", "1000"])
    assert args.api_key == "flag" and args.max_request_bytes == 1000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-request-bytes", "-1"])


async def _echo_length(request: Request) -> JSONResponse:
    return JSONResponse({"read": len(await request.body())})


def _client(**guard) -> TestClient:
    app = Starlette(
        routes=[
            Route(path, _echo_length, methods=["POST", "GET", "OPTIONS"]) for path in ("/v1/x", "/health")
        ]
    )
    return TestClient(RequestGuard(app, **guard))


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_bodies_over_the_limit_are_413_and_at_the_limit_pass(chunked):
    http = _client(api_key=None, max_request_bytes=1000)

    def post(size: int):
        body = b"a" * size
        return http.post("/v1/x", content=iter([body[:600], body[600:]]) if chunked else body)

    assert post(1000).json() == {"read": 1000}
    response = post(1001)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert "1000 bytes" in response.json()["error"]["message"]
    assert _client(api_key=None, max_request_bytes=None).post("/v1/x", content=b"a" * 5000).json() == {
        "read": 5000
    }


def test_the_api_key_guards_v1_only():
    http = _client(api_key="k", max_request_bytes=None)
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "k"},
        {"Authorization": "Basic k"},
    ):
        response = http.post("/v1/x", content=b"{}", headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert http.post("/v1/x", content=b"{}", headers={"Authorization": "bearer k"}).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.options("/v1/x").status_code == 200  # CORS preflights carry no credentials


def test_short_text_is_prepared_on_the_loop_and_the_rest_in_a_thread():
    """Short text only: prepared on the event loop (the thread hop costs more). Long text, audio
    or a malformed part: in a thread, so the loop (and /health) never waits on tokenizing."""
    from omni_pd.entrypoints.openai.prepare import INLINE_PREPARE_CHARS, prepare_inline
    from omni_pd.entrypoints.openai.protocol import ChatCompletionRequest

    def body(*contents):
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": c} for c in contents])

    half = "a" * (INLINE_PREPARE_CHARS // 2)
    assert prepare_inline(body("hello", [{"type": "text", "text": "there"}], None))
    assert prepare_inline(body(half, half))
    assert not prepare_inline(body(half, half + "a"))
    assert not prepare_inline(
        body(
            [
                {"type": "text", "text": "hi"},
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
            ]
        )
    )
    assert not prepare_inline(body([{"type": "text", "text": 3}]))
