"""Layout and accessibility: desktop and phone screenshots (artifacts/), no sideways scrolling on a phone,
every control named for screen readers, Chinese text rendered with a CJK font."""

from __future__ import annotations

import pytest

from server.serving.governor_setup import build_gate
from tests.server.fakes import RecordingEngine, ScriptedEngine
from tests.ui.conftest import DESKTOP, PHONE, screenshot

pytestmark = pytest.mark.browser

CHINESE = "简体中文 流式 输出"


@pytest.fixture
def chat_server(ui_server):
    engine = RecordingEngine(ScriptedEngine(reply=f"Hello! {CHINESE} and more words to wrap the line."))
    return ui_server(engine=engine, gate_factory=build_gate, thermal_source="none")


def converse(page) -> None:
    page.fill("#prompt", "你好，请介绍一下自己。")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .meta')?.textContent.includes('tokens')"
    )


@pytest.mark.parametrize(("name", "viewport"), [("desktop", DESKTOP), ("phone", PHONE)])
def test_layout_when_viewport_then_fits_and_screenshot_saved(chat_server, open_page, name, viewport):
    page = open_page(chat_server, viewport=viewport)
    converse(page)
    page.wait_for_function("() => document.getElementById('level-badge').dataset.level !== 'unknown'")
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at {viewport}"
    for selector in ("#prompt", "#send", "#messages", "#device", "#chart"):
        box = page.locator(selector).bounding_box()
        assert box and box["width"] > 0 and box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"]
    path = screenshot(page, f"ui-{name}.png")
    assert path.stat().st_size > 10_000


def test_layout_when_screen_reader_then_every_control_has_a_name(chat_server, open_page):
    page = open_page(chat_server)
    for label in (
        "Message",
        "Temperature",
        "Max tokens",
        "Drop oldest turns when too long",
        "Treat this page as a background app",
    ):
        assert page.get_by_label(label, exact=True).count() == 1, label
    for button in ("Send", "New chat", "API key"):
        assert page.get_by_role("button", name=button, exact=True).count() == 1, button
    assert page.get_by_role("log", name="Conversation").count() == 1
    assert page.get_by_role("img", name="throttling threshold").count() == 1  # the chart's text alternative
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('input, textarea, button, select')]
            .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                          && !el.textContent.trim())
            .map(el => el.id)"""
    )
    assert unnamed == []


def test_layout_when_chinese_text_then_rendered_with_cjk_glyphs(chat_server, open_page):
    page = open_page(chat_server)
    converse(page)
    # Without a CJK font every character is drawn as the same narrow "tofu" box; CJK glyphs are
    # full-width (about 1 em each). Measure with the page's own font on a canvas.
    widths = page.evaluate(
        """(text) => {
            const style = getComputedStyle(document.querySelector('.msg.assistant .content'));
            const ctx = document.createElement('canvas').getContext('2d');
            ctx.font = style.font;
            return {cjk: [...text.replace(/ /g, '')].map(c => ctx.measureText(c).width),
                    tofu: ctx.measureText('\\u{10FFFD}').width, em: parseFloat(style.fontSize)};
        }""",
        CHINESE,
    )
    assert CHINESE in page.inner_text(".msg.assistant .content")
    assert all(w >= 0.9 * widths["em"] for w in widths["cjk"]), widths
    assert all(abs(w - widths["tofu"]) > 0.5 for w in widths["cjk"]), widths
