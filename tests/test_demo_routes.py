"""The voice demo page's server side, in process against a scripted orchestrator: the routes and
their headers, `--no-demo-page`, and every file the page loads (the page itself runs in a
browser in e2e/test_demo_page.py; the key it offers as a subprotocol is checked in
test_realtime_subprotocols.py)."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient
from test_openai_stream_audio import ScriptedOmni

from omni_pd.entrypoints.cli import build_parser
from omni_pd.entrypoints.openai.api_server import create_app
from omni_pd.entrypoints.openai.demo import DEMO_DIR

KEY = "sk-demo-unit"


def _client(**app_args) -> TestClient:
    return TestClient(create_app(lambda: ScriptedOmni(), "m", **app_args), follow_redirects=False)


def _ready(http: TestClient) -> TestClient:
    deadline = time.monotonic() + 30
    while http.get("/health").status_code != 200:  # the scripted stages start at once
        assert time.monotonic() < deadline, "the app never became healthy"
    return http


@pytest.fixture(scope="module")
def http():
    with _client(api_key=KEY) as client:
        yield _ready(client)


def test_the_page_is_served_at_demo_and_the_root_redirects_to_it(http):
    root = http.get("/")
    assert root.status_code in (302, 307) and root.headers["location"] == "/demo/"
    page = http.get("/demo/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="app.js">' in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    script = http.get("/demo/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    # The key is asked for in the page, never part of it.
    assert KEY not in page.text and KEY not in script.text
    missing = http.get("/demo/nothing.js")
    assert missing.status_code == 404 and "error" in missing.json()


def test_the_config_says_a_key_is_needed_and_lists_the_voices(http):
    config = http.get("/demo/config.json").json()
    assert config == {
        "model": "m",
        "realtime_path": "/v1/realtime",
        "api_key_required": True,
        "ready": True,
        "voices": ["ethan"],
    }
    with _client() as open_server:
        assert _ready(open_server).get("/demo/config.json").json()["api_key_required"] is False


def test_no_demo_page_turns_it_off():
    assert build_parser().parse_args(["serve"]).no_demo_page is False
    assert build_parser().parse_args(["serve", "--no-demo-page"]).no_demo_page is True
    with _client(demo_page=False) as off:
        for path in ("/", "/demo/", "/demo/app.js", "/demo/config.json"):
            assert off.get(path).status_code == 404, path


def test_every_file_the_page_loads_is_served(http):
    """Imports, worklet modules and links, read from the files themselves: a renamed file or a
    typo fails here, not only in a browser."""
    loaded = set()
    for source in DEMO_DIR.iterdir():
        text = source.read_text()
        loaded.update(re.findall(r"""from\s+['"]\./([\w.-]+)['"]""", text))
        loaded.update(re.findall(r"""new URL\(['"]\./([\w.-]+)['"]""", text))
        loaded.update(re.findall(r"""(?:src|href)="([\w.-]+\.(?:js|css))\"""", text))
    assert {
        "app.js",
        "style.css",
        "audio.js",
        "realtime.js",
        "view.js",
        "capture-worklet.js",
        "player-worklet.js",
    } <= loaded
    for name in sorted(loaded):
        assert (DEMO_DIR / name).is_file(), name
        assert http.get(f"/demo/{name}").status_code == 200, name
