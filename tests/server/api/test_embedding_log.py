"""One log line per embedding request, as per completion: the route, the model, how many inputs and tokens,
the outcome and the time; never the texts."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.server.api.embedding_store import ENCODER, encoder_home, encoder_server

SECRET = "a sentence nobody may read in a log"


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    return encoder_home(tmp_path_factory.mktemp("encoder-log"), tiny_gguf)


def lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "simmer.request" and " embeddings " in r.getMessage()]


def test_embedding_log_when_answered_or_refused_then_one_line_of_numbers_each(live, tmp_path, home, caplog):
    srv = encoder_server(live, tmp_path, home[0])
    with caplog.at_level(logging.INFO, logger="simmer.request"):
        ok = httpx.post(
            srv.url + "/v1/embeddings", json={"model": ENCODER, "input": [SECRET, "two"]}, timeout=60
        )
        assert ok.status_code == 200
        ollama = httpx.post(srv.url + "/api/embed", json={"model": ENCODER, "input": SECRET}, timeout=60)
        assert ollama.status_code == 200
    logged = lines(caplog)
    assert [r.fields["endpoint"] for r in logged] == ["/v1/embeddings", "/api/embed"]  # type: ignore[attr-defined]
    first = logged[0].fields  # type: ignore[attr-defined]
    assert first["model"] == ENCODER and first["inputs"] == 2 and first["outcome"] == "ok"
    assert first["tokens"] == ok.json()["usage"]["prompt_tokens"] > 0
    assert all(SECRET not in r.getMessage() and SECRET not in str(r.fields) for r in logged)  # type: ignore[attr-defined]
