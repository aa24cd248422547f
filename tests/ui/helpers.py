"""Browser tests' helpers: send a message in the chat page and wait for the reply to end."""

from __future__ import annotations

REPLY_STATE = """() => {
  const r = document.querySelector('.msg.assistant:last-of-type');
  return r ? {text: r.querySelector('.content').textContent, busy: r.getAttribute('aria-busy'),
              status: r.querySelector('.status').textContent, meta: r.querySelector('.meta').textContent}
           : {text: '', busy: 'true', status: '', meta: ''};
}"""


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_reply_end(page) -> dict:
    page.wait_for_function("() => document.getElementById('messages').getAttribute('aria-busy') === 'false'")
    return page.evaluate(REPLY_STATE)
