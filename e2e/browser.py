"""Headless Chromium for the end-to-end tests: Debian's `chromium` driven through its
`chromium-driver` by Selenium, with a fake microphone that plays a WAV file (in a loop, from the
moment a page opens the microphone) and auto-granted microphone permission.

`require_browser()`: skipped with an install hint outside CI when Chromium, its driver or
Selenium is missing, failed under CI=true (scripts/test.sh installs them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

INSTALL_HINT = (
    "the browser tests need Debian's chromium and chromium-driver and the selenium "
    "package: run `OMNI_PD_BROWSER=1 bash scripts/setup.sh` (scripts/test.sh does)"
)
# What headless Chromium needs as root on a machine whose network is closed: no sandbox (root),
# no GPU, and none of its own calls home (refused connections would log errors).
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--window-size=1000,800",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
)


def chromium_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver), from OMNI_PD_CHROMIUM / OMNI_PD_CHROMEDRIVER or Debian's
    places; None when either is missing."""
    chromium = os.environ.get("OMNI_PD_CHROMIUM") or next(
        (
            p
            for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "")
            if p and os.access(p, os.X_OK)
        ),
        None,
    )
    driver = os.environ.get("OMNI_PD_CHROMEDRIVER") or shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def require_browser() -> tuple[str, str]:
    """Call at module level."""
    paths = chromium_paths()
    try:
        import selenium  # noqa: F401
    except ImportError:
        paths = None
    if paths:
        return paths
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI=true but {INSTALL_HINT}", pytrace=False)
    pytest.skip(INSTALL_HINT, allow_module_level=True)


class Browser:
    """One headless Chromium whose microphone plays `microphone_wav`; `driver` is Selenium's."""

    def __init__(self, microphone_wav: Path) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        chromium, driver = require_browser()
        self.profile = tempfile.mkdtemp(prefix="omni-pd-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in (
            *FLAGS,
            f"--user-data-dir={self.profile}",
            f"--use-file-for-fake-audio-capture={microphone_wav}",
        ):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.console: list[dict] = []  # every console entry read so far

    def console_errors(self) -> list[dict]:
        """The console's errors (level SEVERE: console.error, uncaught exceptions, failed loads)
        since the browser started."""
        self.console += self.driver.get_log("browser")  # each call returns the entries since the last
        return [entry for entry in self.console if entry["level"] == "SEVERE"]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
