"""The page's SSE parser (server/static/js/sse.js), run in the browser on awkward chunkings."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

PARSE = """async (chunks) => {
  const { SSEParser } = await import('/static/js/sse.js');
  const parser = new SSEParser();
  const out = [];
  for (const c of chunks) out.push(...parser.push(c));
  return out;
}"""

STREAM = (
    ": ping\r\n\r\n"
    'data: {"a":1}\r\n\r\n'
    'event: governor\r\ndata: {"level":"critical"}\r\n\r\n'
    "data: line one\ndata: line two\n\n"
    "data:no-space\r\rdata: 中文\n\n"
    "data: [DONE]\n\n"
)
EXPECTED = [
    {"event": "message", "data": '{"a":1}'},
    {"event": "governor", "data": '{"level":"critical"}'},
    {"event": "message", "data": "line one\nline two"},
    {"event": "message", "data": "no-space"},
    {"event": "message", "data": "中文"},
    {"event": "message", "data": "[DONE]"},
]


@pytest.fixture
def page(ui_server, open_page):
    return open_page(ui_server(), wait_model=False)


@pytest.mark.parametrize("size", [len(STREAM), 1, 2, 3, 7])
def test_sse_parser_when_stream_split_anywhere_then_same_events(page, size):
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert page.evaluate(PARSE, chunks) == EXPECTED


def test_sse_parser_when_event_unterminated_then_not_emitted(page):
    assert page.evaluate(PARSE, ['data: {"a":1}\n\n', "data: half"]) == [
        {"event": "message", "data": '{"a":1}'}
    ]
