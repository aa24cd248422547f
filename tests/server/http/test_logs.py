"""One line per request; JSON lines carry the fields."""

from __future__ import annotations

import json
import logging

from server.logs import JsonFormatter, RequestRecord, log_request


def test_log_request_when_json_formatter_then_one_object_with_fields(caplog) -> None:
    record = RequestRecord(
        id="chatcmpl-1",
        endpoint="chat",
        model="m",
        variant="q4",
        stream=True,
        prompt_tokens=5,
        completion_tokens=7,
        sent_tokens=7,
        ttft_ms=12.5,
        tokens_per_s=30.0,
        outcome="stop",
        duration_ms=250.0,
    )
    with caplog.at_level(logging.INFO, logger="simmer.request"):
        log_request(record)
    assert len(caplog.records) == 1
    line = JsonFormatter().format(caplog.records[0])
    entry = json.loads(line)
    assert entry["id"] == "chatcmpl-1" and entry["completion_tokens"] == 7 and entry["outcome"] == "stop"
    assert "tok_s=30.0" in entry["message"] and "\n" not in line
