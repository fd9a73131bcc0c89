"""The voice demo page of `omni-pd serve` (on unless `--no-demo-page`): the static files under
demo/ (plain HTML and JS modules, no build step, no library) at /demo/, a redirect to it from /,
and /demo/config.json, what the page needs to know before it connects.

The page talks to /v1/realtime like any client; it holds no key. Where the server has one
(--api-key) the page asks for it and offers it as the subprotocol
`openai-insecure-api-key.<key>` (realtime/subprotocols.py), since browsers cannot set headers
on a websocket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles

DEMO_DIR = Path(__file__).with_name("demo")
DEMO_PATH = "/demo"
# The page loads only its own files and opens only its own server's websocket ('self' covers
# ws:// and wss:// to the same host); the favicon is an empty data: URL.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class _DemoFiles(StaticFiles):
    async def get_response(self, path: str, scope):
        response = await super().get_response(path, scope)
        response.headers["content-security-policy"] = CONTENT_SECURITY_POLICY
        response.headers["x-content-type-options"] = "nosniff"
        response.headers["cache-control"] = "no-cache"  # revalidated: a new server, a new page
        return response


def add_demo_routes(app: FastAPI, state, *, api_key_required: bool, realtime_path: str) -> None:
    """`state`: the server's ServerState (its model, and its voices once the stages are up)."""
    if not (DEMO_DIR / "index.html").is_file():
        raise FileNotFoundError(
            f"the demo page's files are missing from {DEMO_DIR}; reinstall "
            "omni-pd, or start the server with --no-demo-page"
        )

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse(f"{DEMO_PATH}/")

    @app.get(f"{DEMO_PATH}/config.json", include_in_schema=False)
    async def config() -> dict[str, Any]:
        omni = state.omni
        return {
            "model": state.served_model,
            "realtime_path": realtime_path,
            "api_key_required": api_key_required,
            "ready": omni is not None,
            "voices": list(omni.pipeline.voices) if omni is not None else [],
        }

    app.mount(DEMO_PATH, _DemoFiles(directory=DEMO_DIR, html=True), name="demo")
