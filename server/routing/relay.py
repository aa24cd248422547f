"""An upstream reply as the worker's events, so one stream path serves both sides.

The upstream's chunks become exactly what the local worker emits (Started, TokenEvent*, FinishEvent, or
Failed), into the same job sink. Everything after that (coalescing at SIMMER_STREAM_INTERVAL_MS, the chunk
and body shapes, usage, `model` as the client asked) is the code the local side uses: the client cannot
tell the sides apart except by the `route` object and the X-Simmer-Route header.

`ChunkReader` is pure (the caller passes `now`); `relay` is the loop around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from models.types import FinishEvent, Timings, TokenEvent, TopLogprob, Usage
from server.routing.upstream import Endpoint, UpstreamClient, UpstreamFailure
from server.worker import Started


class ChunkReader:
    """Reads one upstream stream. Token events carry the upstream's text exactly as sent; with logprobs,
    one event per token (their texts, when they add up to the delta)."""

    def __init__(self, kind: Endpoint, started_at: float) -> None:
        self.kind = kind
        self.started_at = started_at
        self.first_at: float | None = None
        self.tokens = 0  # token events emitted
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    @property
    def started(self) -> bool:
        """Did any token go out? After that the reply belongs to this side: no fallback, no switch."""
        return self.tokens > 0

    def feed(self, chunk: dict, now: float) -> list[TokenEvent]:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        events: list[TokenEvent] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if self.kind == "chat":
                text = (choice.get("delta") or {}).get("content") or ""
            else:
                text = choice.get("text") or ""
            events += self._events(str(text), choice.get("logprobs"), now)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return events

    def _events(self, text: str, logprobs: Any, now: float) -> list[TokenEvent]:
        entries = _logprob_entries(self.kind, logprobs)
        if not entries:
            return [self._event(text, None, None, None, now)] if text else []
        texts = [e[0] for e in entries]
        if "".join(texts) != text:  # keep the text exact; the logprobs still one per token
            texts = [text] + [""] * (len(entries) - 1)
        return [
            self._event(t, lp, tops, token, now) for t, (token, lp, tops) in zip(texts, entries, strict=True)
        ]

    def _event(
        self,
        text: str,
        logprob: float | None,
        tops: tuple[TopLogprob, ...] | None,
        token_text: str | None,
        now: float,
    ) -> TokenEvent:
        if self.first_at is None:
            self.first_at = now
        event = TokenEvent(
            token_id=-1,  # the upstream's vocabulary is not ours
            text=text,
            index=self.tokens,
            logprob=logprob,
            top_logprobs=tops,
            token_text=token_text,
            elapsed_ms=(now - self.started_at) * 1000,
        )
        self.tokens += 1
        return event

    def finish(self, now: float) -> FinishEvent:
        """The FinishEvent: the upstream's usage (token events stand in for completion tokens if it sent
        none), timings measured here (network included)."""
        u = self.usage or {}
        details = u.get("prompt_tokens_details") or {}
        usage = Usage(
            prompt_tokens=_int(u.get("prompt_tokens")),
            completion_tokens=_int(u.get("completion_tokens"), self.tokens),
            cached_tokens=_int(details.get("cached_tokens") if isinstance(details, dict) else None),
        )
        first = self.first_at if self.first_at is not None else now
        ttft_ms = (first - self.started_at) * 1000
        predicted_ms = (now - first) * 1000
        timings = Timings(
            prompt_n=usage.prompt_tokens,
            prompt_ms=ttft_ms,
            prompt_per_second=usage.prompt_tokens / (ttft_ms / 1000) if ttft_ms > 0 else 0.0,
            predicted_n=usage.completion_tokens,
            predicted_ms=predicted_ms,
            predicted_per_second=usage.completion_tokens / (predicted_ms / 1000) if predicted_ms > 0 else 0.0,
            ttft_ms=ttft_ms,
        )
        reason = "length" if self.finish_reason == "length" else "stop"
        return FinishEvent(finish_reason=reason, usage=usage, timings=timings)


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and value >= 0 else default


def _logprob_entries(kind: Endpoint, logprobs: Any) -> list[tuple[str, float | None, tuple[TopLogprob, ...]]]:
    """(token text, logprob, top alternatives) per token, from OpenAI's chat or completions shape."""
    if not isinstance(logprobs, dict):
        return []
    out = []
    if kind == "chat":
        for entry in logprobs.get("content") or ():
            if not isinstance(entry, dict):
                continue
            tops = tuple(
                TopLogprob(str(t.get("token", "")), float(t.get("logprob", 0.0)), list(t.get("bytes") or []))
                for t in entry.get("top_logprobs") or ()
                if isinstance(t, dict)
            )
            out.append((str(entry.get("token", "")), _float(entry.get("logprob")), tops))
        return out
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    top_maps = logprobs.get("top_logprobs") or []
    for i, token in enumerate(tokens):
        top = top_maps[i] if i < len(top_maps) and isinstance(top_maps[i], dict) else {}
        tops = tuple(TopLogprob(str(t), float(lp), list(str(t).encode())) for t, lp in top.items())
        out.append((str(token), _float(values[i] if i < len(values) else None), tops))
    return out


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


async def relay(
    client: UpstreamClient,
    kind: Endpoint,
    body: dict,
    sink: Callable[[object], None],
    reader: ChunkReader,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Stream one upstream reply into `sink`. Started goes out with the first token (until then the router
    may still fall back to local), then tokens, then one FinishEvent. Raises UpstreamFailure; `reader`
    says whether any token went out."""
    try:
        async for chunk in client.chunks(kind, body):
            for event in reader.feed(chunk, clock()):
                if event.index == 0:
                    sink(Started(0, False, None))
                sink(event)
    except UpstreamFailure as failure:
        # A stream cut after its finish_reason lost nothing but the usage chunk: the reply is whole.
        if not (failure.kind == "dropped" and reader.finish_reason is not None):
            raise
    if not reader.started:
        sink(Started(0, False, None))
    sink(reader.finish(clock()))
