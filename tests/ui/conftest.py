"""Browser tests: Debian's Chromium driven by Playwright against a live simmer on a free port.

They skip, with the reason, only when Chromium cannot be launched (tests/install_browser.sh installs it
where it can). Every page fails its test on an uncaught JavaScript error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from server.settings import Settings
from tests.server.conftest import LiveServer, make_settings, start_server
from tests.server.fakes import RecordingEngine, ScriptedEngine

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:  # pragma: no cover - playwright is a dev dependency
        pytest.skip(f"the playwright package is not installed: {err}")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run tests/install_browser.sh (apt-get install chromium)")
    manager = sync_playwright().start()
    try:
        browser = manager.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
    except Exception as err:
        manager.stop()
        pytest.skip(f"Chromium could not be launched: {err}")
    yield browser
    browser.close()
    manager.stop()


@pytest.fixture
def open_page(browser) -> Iterator[Callable[..., object]]:
    """open_page(server, viewport=DESKTOP) -> a Page showing the UI; JS errors fail the test."""
    contexts = []
    errors: list[str] = []

    def make(server: LiveServer, viewport: dict | None = None, wait_model: bool = True):
        context = browser.new_context(viewport=viewport or DESKTOP, locale="en-US")
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.set_default_timeout(10_000)
        page.goto(server.url + "/")
        if wait_model:
            model = server.settings.model if server.engine is None else server.engine.model_id
            page.wait_for_function("m => document.getElementById('model-name').textContent === m", arg=model)
        return page

    yield make
    for context in contexts:
        context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


@pytest.fixture
def ui_server(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """ui_server(token_delay_s=, reply_tokens=, engine=, gate_factory=, served_factory=, **settings)."""
    servers: list[LiveServer] = []

    def make(
        *,
        engine=None,
        token_delay_s: float = 0.0,
        reply_tokens: int | None = None,
        context_length: int = 512,
        governor=None,
        gate_factory: Callable[[Settings], object] | None = None,
        served_factory: Callable[[Settings], object] | None = None,
        **overrides,
    ) -> LiveServer:
        settings = make_settings(tmp_path, **overrides)
        if gate_factory is not None:
            governor = gate_factory(settings)  # as server/launch.py does: the gate from the settings
        if served_factory is not None:  # several models (server/serving/model_setup.py)
            srv = start_server(settings, served=served_factory(settings), governor=governor)
            servers.append(srv)
            return srv
        if engine is None:
            engine = RecordingEngine(
                ScriptedEngine(
                    token_delay_s=token_delay_s, reply_tokens=reply_tokens, context_length=context_length
                )
            )
        srv = start_server(settings, engine=engine, governor=governor)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, every: float = 0.05) -> bool:
    """Poll `predicate` until it holds (the browser and the server run on their own clocks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def health(server: LiveServer) -> dict:
    return httpx.get(server.url + "/health", timeout=5).json()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
