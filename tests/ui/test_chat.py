"""The chat in a real browser: streamed replies, Stop, history, keyboard, timings, Chinese text."""

from __future__ import annotations

import itertools
import re
import time

import httpx
import pytest

from models.runtime.engine import load_engine
from tests.server.fakes import REPLY, RecordingEngine, ScriptedEngine
from tests.ui.conftest import health, wait_until
from tests.ui.helpers import REPLY_STATE, send, wait_reply_end

pytestmark = pytest.mark.browser


def scripted_words(n: int, reply: str = REPLY) -> str:
    words = re.findall(r"\s*\S+", reply)
    return "".join(words[i % len(words)] for i in range(n))


def prompt_text(engine: RecordingEngine, index: int) -> str:
    # ScriptedEngine tokenizes one character per token: the prompt ids are the rendered conversation.
    return "".join(chr(i) for i in engine.generations[index].prompt.ids)


def test_chat_when_prompt_sent_then_reply_grows_in_steps_before_it_completes(ui_server, open_page):
    srv = ui_server(token_delay_s=0.06, reply_tokens=16)
    page = open_page(srv)
    send(page, "Tell me about foxes")
    partial: list[str] = []
    state = page.evaluate(REPLY_STATE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = page.evaluate(REPLY_STATE)
        if state["busy"] == "false":
            break
        if state["text"] and (not partial or partial[-1] != state["text"]):
            partial.append(state["text"])
        time.sleep(0.02)
    final = state["text"]
    assert final == scripted_words(16)
    growing = [p for p in partial if p != final]
    assert len(growing) >= 3, f"the reply came in {len(growing)} steps: {growing}"
    assert all(final.startswith(p) for p in growing)  # each step extends the one before
    assert all(len(a) < len(b) for a, b in itertools.pairwise(growing))
    assert "TTFT" in state["meta"] and "16 tokens" in state["meta"]


def test_chat_when_stop_clicked_then_server_cancels_and_takes_the_next_request(ui_server, open_page):
    srv = ui_server(token_delay_s=0.05, reply_tokens=2000)
    page = open_page(srv)
    send(page, "Count forever")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 0")
    page.click("#stop")
    state = wait_reply_end(page)
    assert "Stopped" in state["status"]
    engine = srv.engine
    assert engine.wait_for(lambda gens: gens[0].finish is not None or gens[0].error is not None)
    assert engine.generations[0].finish.finish_reason == "cancelled"
    assert engine.generations[0].tokens < 2000
    assert wait_until(lambda: health(srv)["queue_depth"] == 0 and not health(srv)["busy"], timeout=5)
    # The worker is free: the next reply (the stopped one's text kept in the history) completes.
    page.fill("#max-tokens", "3")
    send(page, "And now?")
    state = wait_reply_end(page)
    assert state["text"] == scripted_words(3)
    assert scripted_words(1) in prompt_text(engine, 1)  # the stopped reply's words went with the history


def test_chat_when_second_turn_then_whole_history_is_sent(ui_server, open_page):
    srv = ui_server(token_delay_s=0.0, reply_tokens=5)
    page = open_page(srv)
    send(page, "first question")
    first = wait_reply_end(page)["text"]
    send(page, "second question")
    wait_reply_end(page)
    sent = prompt_text(srv.engine, 1)
    assert (
        sent.index("<user>first question")
        < sent.index(f"<assistant>{first}")
        < sent.index("<user>second question")
    )
    assert page.locator(".msg").count() == 4


def test_chat_when_shift_enter_then_newline_and_enter_sends(ui_server, open_page):
    srv = ui_server(reply_tokens=2)
    page = open_page(srv)
    page.click("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert srv.engine.generations == []  # Shift+Enter did not send
    assert page.input_value("#prompt") == "line one\nline two"
    page.keyboard.press("Enter")
    wait_reply_end(page)
    assert "<user>line one\nline two\n" in prompt_text(srv.engine, 0)
    assert page.input_value("#prompt") == ""


def test_chat_when_temperature_and_max_tokens_set_then_request_carries_them(ui_server, open_page):
    srv = ui_server(reply_tokens=50)
    page = open_page(srv)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "4")
    send(page, "short please")
    state = wait_reply_end(page)
    params = srv.engine.generations[0].params
    assert params.sampling.temperature == 0.0
    assert params.max_tokens == 4
    assert state["text"] == scripted_words(4)
    assert "max-tokens limit" in state["status"]


def test_chat_when_chinese_text_then_sent_and_streamed_intact(ui_server, open_page):
    reply = "你好 世界 今天 天气 很好"
    engine = RecordingEngine(ScriptedEngine(reply=reply, token_delay_s=0.02))
    srv = ui_server(engine=engine)
    page = open_page(srv)
    send(page, "用中文回答")
    state = wait_reply_end(page)
    assert state["text"] == reply
    assert "<user>用中文回答" in prompt_text(engine, 0)
    assert page.locator(".msg.user .content").inner_text() == "用中文回答"


def test_chat_with_tiny_real_model_when_reply_ends_then_timings_and_variant_shown(
    ui_server, open_page, tiny_model_dir
):
    engine = RecordingEngine(load_engine(tiny_model_dir, threads=1, context_length=256))
    srv = ui_server(engine=engine, model=engine.model_id)
    page = open_page(srv)
    assert page.inner_text("#model-variant") == engine.variant
    page.fill("#max-tokens", "12")
    send(page, "hello")
    state = wait_reply_end(page)
    finish = engine.generations[0].finish
    assert finish is not None
    assert state["text"]  # random weights, real tokens
    assert f"{finish.usage.completion_tokens} tokens" in state["meta"]
    assert re.search(r"TTFT \d+ ms", state["meta"]) and "tok/s" in state["meta"]
    assert state["meta"].endswith(engine.variant)
    models = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert page.inner_text("#model-context") == f"{models['context_length']} tokens"
