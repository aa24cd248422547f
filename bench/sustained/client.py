"""The benchmark's HTTP client: one streamed request, read as a user sees it (first token, pauses mid-reply,
where it was served), its tokens timed chunk by chunk."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot learning to cook.",
    "What are three tips for staying focused while studying?",
    "Describe a walk through a forest in autumn.",
    "Why do cats like boxes?",
    "Give me a recipe idea for a quick dinner.",
    "What is the difference between weather and climate?",
    "Write a haiku about the sea, then explain it.",
]


MAX_TOKENS = 160


@dataclass
class RequestRecord:
    start: float
    ttft_s: float | None
    tokens: int
    ok: bool
    error: str | None = None
    pauses: int = 0  # times the governor paused this reply after its first token (what the user sees)
    pause_times: list[float] = field(default_factory=list)  # monotonic time of each
    served: str | None = None  # "local" | "upstream" (the route object of the final chunk)
    reason: str | None = None  # why it was served there (thermal, offline_first, ...)
    models: dict[str, int] = field(default_factory=dict)  # tokens per model (usage.models; cut: chunks')
    token_times: list[float] = field(default_factory=list)  # when each of its tokens arrived (monotonic)


@dataclass
class RunLog:
    samples: list[dict[str, Any]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # every token sent, replies that failed too
    requests: list[RequestRecord] = field(default_factory=list)
    rss_ready: int = 0
    rss_after: dict[int, int] = field(default_factory=dict)  # requests done -> the server's RSS then
    chars_per_token: list[float] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (simulated s, server CPU s so far)


def request_body(prompt: str, seed: int, endpoint: str = "chat", model: str | None = None) -> dict[str, Any]:
    """One benchmark request: a chat turn, or (endpoint "completions", for base models without a chat
    template) the same question as plain text to continue."""
    body: dict[str, Any] = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
    }
    if endpoint == "completions":
        body["prompt"] = f"Question: {prompt}\nAnswer:"
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if model:
        body["model"] = model
    return body


ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def stream_request(
    client: httpx.Client,
    prompt: str,
    log: RunLog,
    end: float,
    *,
    endpoint: str = "chat",
    model: str | None = None,
) -> RequestRecord:
    body = request_body(prompt, len(log.requests), endpoint, model)
    start = time.monotonic()
    rec = RequestRecord(start, None, 0, False)
    arrivals: list[tuple[float, int]] = []  # (time, characters) of each content chunk
    usage_tokens: int | None = None
    chunk_model: str | None = None
    event = ""
    paused = False
    try:
        with client.stream("POST", ENDPOINTS[endpoint], json=body) as r:
            if r.status_code != 200:
                r.read()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            # "upstream; reason=thermal": known at the start; the final chunk's route object confirms it
            route_header = r.headers.get("x-simmer-route") or ""
            rec.served = route_header.split(";")[0].strip() or None
            rec.reason = route_header.partition("reason=")[2].strip() or None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                    continue
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if event == "governor":
                    event = ""
                    paused = _count_pause(rec, json.loads(data), paused)
                    continue
                if data == "[DONE]":
                    rec.ok = rec.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("code")
                    continue
                now = time.monotonic()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                    rec.models = dict(chunk["usage"].get("models") or {})
                if isinstance(chunk.get("route"), dict):
                    rec.served = chunk["route"].get("served")
                    rec.reason = chunk["route"].get("reason")
                for choice in chunk.get("choices", []):
                    text = _chunk_text(choice)
                    if text:
                        chunk_model = chunk.get("model") or chunk_model
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        arrivals.append((now, len(text)))
                if now > end:
                    rec.ok = rec.error is None  # the run is over: stop reading (not a failure)
                    break
    except httpx.HTTPError as err:
        rec.error = f"{type(err).__name__}: {err}"
    finally:
        rec.tokens = _spread_tokens(arrivals, usage_tokens, log, rec)
        if not rec.models and rec.tokens and chunk_model:  # cut before its usage: the model that ran last
            rec.models = {chunk_model: rec.tokens}
    return rec


def _chunk_text(choice: dict[str, Any]) -> str:
    """A chat chunk's delta content, or a completions chunk's text."""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _count_pause(rec: RequestRecord, state: dict[str, Any], was_paused: bool) -> bool:
    """A governor event during a reply: count a pause that starts after the first token."""
    paused = bool(state.get("limits", {}).get("pause_running"))
    if paused and not was_paused and rec.ttft_s is not None:
        rec.pauses += 1
        rec.pause_times.append(time.monotonic())
    return paused


def _spread_tokens(
    arrivals: list[tuple[float, int]], usage_tokens: int | None, log: RunLog, rec: RequestRecord | None = None
) -> int:
    """A chunk carries the tokens of one 50 ms coalescing window: give each chunk its share of the reply's
    tokens (from usage) by its share of the characters. A reply cut at the end of the run has no usage:
    use the characters-per-token of the replies before it. The times go to the run's log and to `rec`'s."""
    chars = sum(c for _, c in arrivals)
    if not chars:
        return 0
    if usage_tokens is not None:
        log.chars_per_token.append(chars / max(1, usage_tokens))
        total = usage_tokens
    else:
        ratio = statistics.median(log.chars_per_token) if log.chars_per_token else 4.0
        total = max(1, round(chars / ratio))
    seen = given = 0
    for t, c in arrivals:
        seen += c
        n = round(total * seen / chars) - given
        log.token_times.extend([t] * n)
        if rec is not None:
            rec.token_times.extend([t] * n)
        given += n
    return total
