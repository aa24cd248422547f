"""`simmer bench embed-chat`: a chat's pace while a large embedding request runs beside it.

One `simmer serve` process (each token its own chunk: SIMMER_STREAM_INTERVAL_MS=0) with a chat model and
an embedding model installed. Each round streams one long chat alone, then the same chat again with a
request of `--sentences` sentences (bench/embed_sentences.py) sent once the chat has streamed for a second,
then that request alone. Reported per round: the chat's inter-token gaps alone (median, p95, max) and,
beside the request, over the time the request ran (p95 and max against the alone p95), with how long the
request took beside the chat and alone.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

import httpx

from bench.cold_start import token_times
from bench.embed_bench import cpu_class
from bench.embed_sentences import sentences as make_sentences
from bench.sustained.process import server_process
from server.settings import Settings

ENCODER = "all-minilm-l6-v2"


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _gaps(times: list[float], start: float | None = None, end: float | None = None) -> list[float]:
    """The gaps between tokens; with `start`/`end`, those that end after start and begin before end."""
    return [
        b - a
        for a, b in itertools.pairwise(times)
        if (start is None or b > start) and (end is None or a < end)
    ]


def _p95(gaps: list[float]) -> float:
    return statistics.quantiles(gaps, n=20)[-1] if len(gaps) >= 2 else gaps[0]


def _embed(url: str, texts: list[str]) -> tuple[float, float, int]:
    """(sent, answered) on the monotonic clock and the vectors returned."""
    sent = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", json={"model": ENCODER, "input": texts}, timeout=600)
    r.raise_for_status()
    return sent, time.monotonic(), len(r.json()["data"])


def run_round(url: str, model: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
    alone: list[float] = []
    token_times(url, model, max_tokens, alone)
    beside: list[float] = []
    chat = threading.Thread(target=token_times, args=(url, model, max_tokens, beside))
    chat.start()
    time.sleep(1.0)
    sent, answered, vectors = _embed(url, texts)
    chat.join()
    embed_alone_sent, embed_alone_done, _ = _embed(url, texts)
    gaps_alone = _gaps(alone)
    during = _gaps(beside, sent, answered)
    p95_alone = _p95(gaps_alone)
    chat_ended_first = bool(beside) and beside[-1] < answered
    return {
        "vectors": vectors,
        "chat_tokens": len(alone),
        "alone_gap_ms": {
            "median": _ms(statistics.median(gaps_alone)),
            "p95": _ms(p95_alone),
            "max": _ms(max(gaps_alone)),
        },
        "beside_gap_ms": {
            "gaps": len(during),
            "median": _ms(statistics.median(during)) if during else None,
            "p95": _ms(_p95(during)) if during else None,
            "max": _ms(max(during)) if during else None,
        },
        "p95_over_alone": round(_p95(during) / p95_alone, 2) if during else None,
        "max_over_alone_median": round(max(during) / statistics.median(gaps_alone), 2) if during else None,
        "embed_beside_s": round(answered - sent, 2),
        "embed_alone_s": round(embed_alone_done - embed_alone_sent, 2),
        "chat_ended_before_the_embeddings": chat_ended_first,
    }


def bench_embed_chat(
    settings: Settings, *, model: str | None, n_sentences: int, rounds: int, max_tokens: int
) -> dict[str, Any]:
    texts = make_sentences(n_sentences)
    update: dict[str, Any] = {"stream_interval_ms": 0}
    if model:
        update["model"] = model
    with server_process(settings.model_copy(update=update)) as srv:
        chat_model = httpx.get(srv.url + "/health", timeout=5).json().get("model") or model or ""
        _embed(srv.url, texts[:64])  # the encoder opened, the chat model warm
        token_times(srv.url, chat_model, 16, [])
        runs = [run_round(srv.url, chat_model, texts, max_tokens) for _ in range(rounds)]
    ratios = [r["p95_over_alone"] for r in runs if r["p95_over_alone"] is not None]
    return {
        "benchmark": "embed-chat",
        "cpu_class": cpu_class(),
        "chat_model": chat_model,
        "embedding_model": ENCODER,
        "sentences": n_sentences,
        "chat_max_tokens": max_tokens,
        "rounds": runs,
        "p95_over_alone_median": statistics.median(ratios) if ratios else None,
    }
