"""An upstream reply as the worker's events, so one stream path serves both sides.

The upstream's chunks become exactly what the local worker emits (Started, TokenEvent*, FinishEvent, or
Failed), into the same job sink. Everything after that (coalescing at SIMMER_STREAM_INTERVAL_MS, the chunk
and body shapes, usage, `model` as the client asked) is the code the local side uses: the client cannot
tell the sides apart except by the `route` object and the X-Simmer-Route header.

`ChunkReader` is pure (the caller passes `now`); `relay` is the loop around it.

An upstream is trusted with nothing (docs/routing.md): whatever it sends, a relayed reply is bounded.
- tokens: the client's max_tokens (else MAX_RELAY_TOKENS), and MAX_RELAY_TEXT_BYTES of text: then the
  reply ends with `length` and the upstream's response is closed (a 1 GB stream is never read);
- time: no token for `stall_s` (silence, comment pings, or a byte at a time all count as no progress) and
  the whole reply past `deadline_s` end it with an `timeout` failure (an error event after the first token);
- values: numbers it reports (usage, logprobs) are used only when in range; anything else is ignored.
Bytes per event and per error body are upstream.py's bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from models.types import FinishEvent, Timings, TokenEvent, TopLogprob, Usage
from server.routing.upstream import Endpoint, UpstreamClient, UpstreamFailure
from server.serving.events import Started

MAX_RELAY_TOKENS = 32_768  # a reply's tokens when the client set no max_tokens
MAX_RELAY_TEXT_BYTES = 4 << 20  # a reply's text (a 32k-token reply is about 128 KB)
MAX_COUNT = 2**31 - 1  # a token count the upstream reports, at most


class ChunkReader:
    """Reads one upstream stream. Token events carry the upstream's text exactly as sent; with logprobs,
    one event per token (their texts, when they add up to the delta). At most `max_tokens` token events
    and MAX_RELAY_TEXT_BYTES of text: then `full` (the reply ends with `length`)."""

    def __init__(self, kind: Endpoint, started_at: float, max_tokens: int | None = None) -> None:
        self.kind = kind
        self.started_at = started_at
        self.first_at: float | None = None
        self.tokens = 0  # token events emitted
        self.text_bytes = 0
        self.max_tokens = min(max_tokens or MAX_RELAY_TOKENS, MAX_RELAY_TOKENS)
        self.full = False  # the bound was reached: the reply ends here (length)
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
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0 or self.full:
                continue
            if self.kind == "chat":
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
            else:
                text = choice.get("text")
            events += self._events(text if isinstance(text, str) else "", choice.get("logprobs"), now)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])[:32]
        return events

    def _events(self, text: str, logprobs: Any, now: float) -> list[TokenEvent]:
        entries = _logprob_entries(self.kind, logprobs)
        if not entries:
            event = self._event(text, None, None, None, now) if text else None
            return [event] if event is not None else []
        texts = [e[0] for e in entries]
        if "".join(texts) != text:  # keep the text exact; the logprobs still one per token
            texts = [text] + [""] * (len(entries) - 1)
        return [
            event
            for t, (token, lp, tops) in zip(texts, entries, strict=True)
            if (event := self._event(t, lp, tops, token, now)) is not None
        ]

    def _event(
        self,
        text: str,
        logprob: float | None,
        tops: tuple[TopLogprob, ...] | None,
        token_text: str | None,
        now: float,
    ) -> TokenEvent | None:
        """The next token event, or None once the reply is at its bound (`full`)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if self.full or self.tokens >= self.max_tokens or self.text_bytes + size > MAX_RELAY_TEXT_BYTES:
            self.full = True
            return None
        self.text_bytes += size
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
        reason = "length" if self.full or self.finish_reason == "length" else "stop"
        return FinishEvent(finish_reason=reason, usage=usage, timings=timings)


def _int(value: Any, default: int = 0) -> int:
    """A count the upstream reports, if it is one (a 400-digit number is not: it gave a 500)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else default


def _logprob_entries(kind: Endpoint, logprobs: Any) -> list[tuple[str, float | None, tuple[TopLogprob, ...]]]:
    """(token text, logprob, top alternatives) per token, from OpenAI's chat or completions shape."""
    if not isinstance(logprobs, dict):
        return []
    out = []
    if kind == "chat":
        for entry in _list(logprobs.get("content")):
            if not isinstance(entry, dict):
                continue
            tops = tuple(
                TopLogprob(str(t.get("token", "")), lp, _bytes(t.get("bytes"), str(t.get("token", ""))))
                for t in _list(entry.get("top_logprobs"))
                if isinstance(t, dict) and (lp := _float(t.get("logprob"))) is not None
            )
            out.append((str(entry.get("token", "")), _float(entry.get("logprob")), tops))
        return out
    tokens = _list(logprobs.get("tokens"))
    values = _list(logprobs.get("token_logprobs"))
    top_maps = _list(logprobs.get("top_logprobs"))
    for i, token in enumerate(tokens):
        top = top_maps[i] if i < len(top_maps) and isinstance(top_maps[i], dict) else {}
        tops = tuple(
            TopLogprob(str(t), v, list(str(t).encode()))
            for t, lp in top.items()
            if (v := _float(lp)) is not None
        )
        out.append((str(token), _float(values[i] if i < len(values) else None), tops))
    return out


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _float(value: Any) -> float | None:
    """A logprob the upstream reports, if it is one: a finite number (1e400 overflows, NaN is no JSON)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _bytes(value: Any, token: str) -> list[int]:
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return value
    return list(token.encode("utf-8", "surrogatepass"))


async def relay(
    client: UpstreamClient,
    kind: Endpoint,
    body: dict,
    sink: Callable[[object], None],
    reader: ChunkReader,
    *,
    clock: Callable[[], float] = time.monotonic,
    stall_s: float = 120.0,
    deadline_s: float = 600.0,
) -> None:
    """Stream one upstream reply into `sink`. Started goes out with the first token (until then the router
    may still fall back to local), then tokens, then one FinishEvent. Raises UpstreamFailure; `reader`
    says whether any token went out. At its bound (`reader.full`) the reply ends with `length` and the
    upstream's response is closed. From the response's headers on, no token for `stall_s` is a `timeout`
    (before them httpx's pool, connect and read timeouts apply); so is `deadline_s` in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    stalled = False  # what the timer set last: the stall (True) or the deadline

    def progress() -> None:
        nonlocal stalled
        stalled = loop.time() + stall_s < deadline
        limit.reschedule(min(loop.time() + stall_s, deadline))

    try:
        async with (
            asyncio.timeout_at(deadline) as limit,
            contextlib.aclosing(client.chunks(kind, body, on_response=progress)) as chunks,
        ):
            async for chunk in chunks:
                for event in reader.feed(chunk, clock()):
                    if event.index == 0:
                        sink(Started(0, False, None))
                    sink(event)
                    progress()
                if reader.full:
                    break  # the rest is never read: closing the stream closes the response
    except TimeoutError:
        why = f"no token for {stall_s:g} s" if stalled else f"the reply took over {deadline_s:g} s"
        raise UpstreamFailure("timeout", why) from None
    except UpstreamFailure as failure:
        # A stream cut after its finish_reason lost nothing but the usage chunk: the reply is whole.
        if not (failure.kind == "dropped" and reader.finish_reason is not None):
            raise
    if not reader.started:
        sink(Started(0, False, None))
    sink(reader.finish(clock()))
