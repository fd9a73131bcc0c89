"""The voice demo page in a real browser: headless Chromium (e2e/browser.py) whose fake
microphone plays espeak-ng speech in a loop, against live servers with an API key: the tiny
Qwen3-Omni colocated and P/D, and the tiny Qwen2.5-Omni P/D.

Per server: a wrong key is refused and the right one connects; hands-free, a spoken turn is
answered (transcript shown, audio played, TTFA shown) and the next utterance of the loop barges
in (playback stops, the answer is truncated to what was played); hold to talk, a press during a
running answer cancels it (response.cancel). No console errors, no error events, and nothing
left on the server. OMNI_PD_DEMO_SCREENSHOT=PATH saves the page after the colocated turn there
(docs/demo_page.png)."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import websockets.sync.client
import yaml
from browser import Browser, require_browser
from live_server import Server, omni_pd_serve_command, wait_for
from speech import pcm16, speak

from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME as QWEN2_5_OMNI
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
require_browser()

from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

API_KEY = "sk-demo-page-test"
RATE = 24_000
# The microphone's loop: silence, the utterance, silence. VAD ends a turn 0.5 s into the silence,
# and the next utterance barges in about TAIL_S + 0.15 s after that (the loop's lead, then 150 ms
# of voiced frames): inside the tiny talker's 5 s answer for any TTFA under 3.6 s.
LEAD_S, TAIL_S = 0.5, 3.5
# max_output_tokens of the hold-to-talk session: the tiny thinker takes seconds over them, so the
# answer is still running when the test presses again.
LONG = 2000
PAGE_S = 90  # a deadline for anything the page waits on


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> tuple[Path, float]:
    """The fake microphone's WAV and the utterance's length in seconds."""
    speech = speak("Hello, what is the weather like today?")
    loop = np.concatenate(
        [np.zeros(int(LEAD_S * RATE), np.float32), speech, np.zeros(int(TAIL_S * RATE), np.float32)]
    )
    path = tmp_path_factory.mktemp("microphone") / "speech.wav"
    soundfile.write(path, np.frombuffer(pcm16(loop), dtype="<i2"), RATE, subtype="PCM_16")
    return path, len(speech) / RATE


@pytest.fixture(scope="module")
def browser(microphone):
    chromium = Browser(microphone[0])
    try:
        yield chromium
    finally:
        chromium.close()


def _warm_up(server: Server, wav: Path) -> None:
    """One spoken turn over a plain websocket: a server's first audio input takes about a
    second more than later ones (docs/realtime.md), which the page's timings need not absorb."""
    url = server.base.replace("http", "ws", 1) + "/v1/realtime"
    with websockets.sync.client.connect(url, additional_headers=server.headers) as ws:
        audio = base64.b64encode(soundfile.read(wav, dtype="int16")[0].tobytes()).decode()
        for event in (
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            },
            {"type": "input_audio_buffer.append", "audio": audio},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            ws.send(json.dumps(event))
        while (event := json.loads(ws.recv(timeout=120)))["type"] != "response.done":
            assert event["type"] != "error", event


# Each server: its model and stage file (None: omni-pd serve's default, the tiny Qwen3-Omni P/D).
SERVERS = {
    "colocated": (None, STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"),
    "pd": (None, None),
    "qwen2_5_omni_pd": (QWEN2_5_OMNI, STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_pd.yaml"),
}
# The tiny Qwen2.5-Omni's talker makes 50 codes a second and samples its end at random (its CI
# stage file stops it at 64 codes, 1.3 s): the barge-in needs an answer that outlasts the
# microphone loop's gap, so its talker is served at ignore_eos and 5 s of codes.
QWEN2_5_OMNI_TALKER = {"max_tokens": 250, "ignore_eos": True}


def _long_talker(stages: Path, folder: Path) -> Path:
    config = yaml.safe_load(stages.read_text())
    (talker,) = [s for s in config["stage_args"] if s["engine_args"]["model_stage"] == "talker"]
    talker["default_sampling_params"].update(QWEN2_5_OMNI_TALKER)
    path = folder / stages.name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, microphone, tmp_path_factory):
    model, stages = SERVERS[request.param]
    if model == QWEN2_5_OMNI:
        stages = _long_talker(stages, tmp_path_factory.mktemp("stages"))

    def command(port):
        argv = omni_pd_serve_command(port, model=model)
        return argv + (["--stage-configs-path", str(stages)] if stages else [])

    srv = Server(command=command, api_key=API_KEY)
    srv.kind = request.param
    try:
        _warm_up(srv, microphone[0])
        yield srv
    finally:
        srv.stop()


class Page:
    """The demo page in `browser`, opened from the server's root URL."""

    def __init__(self, browser: Browser, server: Server) -> None:
        self.driver, self.browser, self.server = browser.driver, browser, server
        self.driver.get(f"{server.base}/")
        assert self.driver.current_url == f"{server.base}/demo/"  # / redirects to the page
        self.wait(lambda s: s["status"] == "ready", "the page to load its config")

    def snapshot(self) -> dict:
        return self.driver.execute_script("return window.demo.snapshot()")

    def wait(self, condition, what: str, timeout_s: float = PAGE_S) -> dict:
        """The first snapshot for which `condition(snapshot)` holds."""
        last = {}

        def check():
            last.clear()
            last.update(self.snapshot())
            assert not last["pageErrors"], f"the page failed: {last['pageErrors']}"
            assert not last["serverErrors"], f"the server sent errors: {last['serverErrors']}"
            return condition(last)

        try:
            wait_for(check, timeout_s, what)
        except AssertionError as timeout:
            state = {key: last.get(key) for key in ("status", "message", "turns", "eventCounts")}
            raise AssertionError(f"{timeout}; the page's last state: {json.dumps(state)}") from None
        return last

    def element(self, element_id: str):
        return self.driver.find_element(By.ID, element_id)

    def connect(self, key: str, mode: str, max_tokens: int | None = None) -> dict:
        field = self.element("api-key")
        assert field.is_displayed()  # the server has a key: the page asks for it
        field.clear()
        field.send_keys(key)
        self.element("mode").find_element(By.CSS_SELECTOR, f"option[value='{mode}']").click()
        tokens = self.element("max-tokens")
        tokens.clear()
        if max_tokens:
            tokens.send_keys(str(max_tokens))
        tries = self.snapshot()["connects"]
        self.element("connect").click()
        return self.wait(
            lambda s: s["connects"] == tries + 1 and s["status"] in ("connected", "refused", "error"),
            "the connection to open or be refused",
        )

    def hold(self) -> None:
        ActionChains(self.driver).click_and_hold(self.element("talk")).perform()

    def release(self) -> None:
        ActionChains(self.driver).release().perform()

    def hang_up_and_check_clean(self) -> None:
        """Disconnect; then the server holds nothing for the session, the page saw no error
        event, and the browser's console has no error."""
        self.element("disconnect").click()
        snapshot = self.wait(lambda s: s["status"] == "closed", "the page to disconnect")
        wait_for(
            lambda: all(v == 0 for v in self.server.state()["counts"].values()),
            30,
            "every per-request and per-session count on the server to return to zero",
        )
        assert snapshot["serverErrors"] == [] and snapshot["pageErrors"] == []
        assert self.browser.console_errors() == []


@pytest.fixture
def page(browser, server):
    return Page(browser, server)


def _answer(turn: dict | None) -> dict:
    return (turn or {}).get("response") or {}


def _unplayed(answer: dict) -> int:
    """Samples of a playing answer received and not played yet (0 before it plays)."""
    return answer["received"] - answer["played"] if answer.get("played", 0) > 0 else 0


def test_a_spoken_turn_is_answered_and_speaking_again_barges_in(page, server, microphone, tmp_path):
    refused = page.connect("not-the-key", "vad")
    assert refused["status"] == "refused" and "API key" in refused["message"], refused["message"]
    assert page.connect(API_KEY, "vad")["status"] == "connected"
    page.element("talk").click()  # hands-free: the microphone streams until clicked again

    # The first turn: VAD ends it, the answer streams, plays, and its transcript shows.
    first = page.wait(
        lambda s: (
            s["turns"]
            and _answer(s["turns"][0]).get("played", 0) > 0
            and _answer(s["turns"][0])["status"] != "in_progress"
        ),
        "the first answer to finish and play",
    )["turns"][0]
    answer = first["response"]
    speech_ms = microphone[1] * 1000
    assert speech_ms - 200 <= first["userMs"] <= speech_ms + 800, (first["userMs"], speech_ms)
    assert answer["status"] in ("completed", "incomplete") and answer["text"]
    assert 0 < answer["ttfaMs"] < 10_000
    assert answer["received"] >= RATE  # the tiny talker speaks ~5 s
    # The loop's next utterance barges in while the answer plays: playback stops where it was,
    # and the conversation keeps the answer as far as it was played.
    after = page.wait(
        lambda s: _answer(s["turns"][0]).get("truncatedMs") is not None,
        "the next utterance to barge in and the answer to be truncated",
    )
    cut = after["turns"][0]["response"]
    assert cut["interrupted"] == "speech" and len(after["turns"]) >= 2
    assert 0 < cut["played"] < cut["received"]
    assert cut["truncatedMs"] == cut["played"] * 1000 // RATE
    # What the page shows: the transcript, the cut, and the turn's TTFA (rounded as JS rounds).
    shown = page.driver.find_elements(By.CSS_SELECTOR, "#turns .turn")[0]
    assert shown.find_element(By.CSS_SELECTOR, ".assistant span").text.strip() == cut["text"].strip()
    assert "interrupted" in shown.get_attribute("class")
    assert f"TTFA {int(cut['ttfaMs'] + 0.5)} ms" in shown.find_element(By.CSS_SELECTOR, ".stats").text
    screenshot = tmp_path / "demo_page.png"
    assert page.driver.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    target = os.environ.get("OMNI_PD_DEMO_SCREENSHOT")
    if target and server.kind == "colocated":
        shutil.copyfile(screenshot, target)
    # Stopped, the played count no longer moves.
    assert page.snapshot()["turns"][0]["response"]["played"] == cut["played"]
    page.hang_up_and_check_clean()


def test_hold_to_talk_and_a_press_cancels_the_running_answer(page):
    assert page.connect(API_KEY, "hold", max_tokens=LONG)["status"] == "connected"
    page.hold()
    page.wait(lambda s: s["turns"] and s["turns"][-1]["sentMs"] >= 1200, "1.2 s of held speech")
    page.release()
    # Playing, with more received than played (a slow server's first chunk, 0.3 s, can play out
    # before the next arrives): the press then cuts it.
    playing = page.wait(
        lambda s: _unplayed(_answer(s["turns"][0])) >= RATE // 2,
        "the answer to play with half a second more of it received",
    )["turns"][0]["response"]
    assert playing["status"] == "in_progress"  # still being made: the press must cancel it
    page.hold()
    after = page.wait(
        lambda s: _answer(s["turns"][0]).get("truncatedMs") is not None,
        "the press to cancel the answer and truncate it",
    )
    cut = after["turns"][0]["response"]
    assert cut["status"] == "cancelled" and cut["reason"] == "client_cancelled"
    assert cut["interrupted"] == "press" and 0 < cut["played"] < cut["received"]
    assert cut["truncatedMs"] == cut["played"] * 1000 // RATE
    # The press started the next turn, answered on release.
    page.wait(lambda s: len(s["turns"]) == 2 and s["turns"][1]["sentMs"] >= 400, "the second turn's speech")
    page.release()
    page.wait(lambda s: _answer(s["turns"][1]).get("played", 0) > 0, "the second answer to play")
    page.hang_up_and_check_clean()
