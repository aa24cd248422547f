"""A sliding window with a summary: keep only the last few turns and one summary of the history.

When the chat window drops turns (the request asked for `truncate`, or the governor's context cap made the
conversation too long, before the reply or during it: `dropped`), the dropped turns are not simply lost:
the smallest chat model writes a running summary of them while the worker is idle, and a later request of
the same conversation carries it as a marked note in its system message.

Why it is shaped like this:
- The API is stateless (the client resends every message), so a summary is keyed by a hash of the dropped
  message prefix: key(i) = sha256(key(i-1) + the canonical JSON of turn i). Any request whose turns start
  with the same i messages finds it, and a client that edits an earlier message simply misses (the chain
  breaks there; the longest unchanged prefix with a summary still serves).
- Never on a reply's critical path: a request only looks summaries up (a dict lookup and one extra prompt
  encoding). Writing one is idle work (serving/contracts.py IdleWork): the worker runs it only while its queue
  is empty, and a submitted job cancels it between two engine steps (one prefill chunk or one token).
  The first request that drops turns is served the plain window and queues the work.
- Look-ahead: in a live chat every new request drops one turn pair more than the last, so a summary of
  exactly the dropped prefix would always be one turn late. The work therefore also summarizes the older
  half of the turns the window kept; the next few requests (the window dropping up to that point) find a
  summary that covers everything they drop, and drop up to that boundary (the summary stands for them).
  Past it, the longest summary still serves (an older part of the history) and an extension is queued: a
  running summary, the previous summary plus the newly dropped turns, chunk by chunk.
- Bounded: a small LRU of summaries, a short queue of pending work (newest first; the oldest goes), each
  message clipped to MESSAGE_CHARS for the summarizer and at most SPAN_MESSAGES new messages per piece of
  work (a hostile history of thousands of turns costs a bounded amount of idle time and memory).
- Keyed by the turns (not the system message, not the model) within the request's cache scope (its API key
  and `cache_salt`: serving/cache_scope.py, as the prefix cache is scoped): a summary is a function of those
  turns only, so it is right for any request of that scope that starts with them. Across scopes it would be
  an oracle: whether a request is `summarized` (and its prompt's size) tells a client that someone else
  sent exactly these turns, so a guessed secret in them is confirmed. Its text goes into that client's own
  system message (what it could write there itself).
- Optional work: it runs only while the governor's level is nominal (`allowed`), and only on a chat model
  that is already loaded (ModelPool.borrow): idle work never loads a model. A load cannot be interrupted
  (1.1-1.9 s for SmolLM2 on a shared 2-core machine, longer on a phone), so a request arriving during one
  would wait for all of it; nor does it unload one (the next request would pay for the reload). The writer
  is the ladder's smallest chat model when it is loaded, else the smallest loaded one above it (at nominal
  level a ladder serves from its top, so the smallest model is seldom loaded; the model that served the
  request is, within its keep_alive). With none loaded (keep_alive 0) the work waits, bounded, and the plain
  window serves.
- Privacy (seed 001: logs never contain prompt text): neither summaries nor messages are ever logged or
  exported; log lines carry counts only.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

from models.errors import SimmerError
from models.protocol import Engine, Prompt
from models.runtime.engine import window_split
from models.types import CancelToken, FinishEvent, GenerationParams, SamplingParams, TokenEvent, ToolUse
from server.serving.cache_scope import SUMMARY_SCOPE

log = logging.getLogger("simmer.summary")

NOTE_MARK = "Summary of the earlier conversation:"
SUMMARY_MAX_TOKENS = 96  # a summary's length: a few sentences, small next to any context we run
STORE_ENTRIES = 32  # summaries kept (LRU): a few conversations' running summaries
PENDING_MAX = 4  # queued pieces of work (newest first); an older one is dropped, not delayed forever
MESSAGE_CHARS = 1200  # characters of one message the summarizer reads (its head; the rest is elided)
SPAN_MESSAGES = 48  # new messages one piece of work summarizes (older ones of a huge span are skipped)
NOTE_SHARE = 4  # a note may take at most 1/NOTE_SHARE of the context, else the plain window serves

FIRST = "Summarize this conversation in two sentences, keeping names and facts about the user:"
UPDATE = "Update the summary in two sentences, keeping names and facts about the user."


def prefix_keys(turns: list[dict], scope: str = "") -> list[str]:
    """keys[i]: the key of turns[: i + 1] in `scope` (a hash chain seeded with the scope, so one pass gives
    every prefix, and no key of one scope is a key of another)."""
    keys: list[str] = []
    h = hashlib.sha256(b"scope\0" + scope.encode("utf-8", "surrogatepass")).digest() if scope else b""
    for m in turns:
        canonical = json.dumps(m, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "replace")
        h = hashlib.sha256(h + canonical).digest()
        keys.append(h.hex())
    return keys


def message_line(m: dict) -> str:
    """One turn as the summarizer reads it: "role: text", tool calls named, content arrays' text parts
    (anything else, an image, as a placeholder), clipped to MESSAGE_CHARS."""
    role = str(m.get("role") or "message").capitalize()
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                parts.append(f"[{p.get('type', 'part') if isinstance(p, dict) else 'part'}]")
        text = " ".join(parts)
    else:
        text = "" if content is None else str(content)
    for call in m.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            text += f" [called {fn.get('name')}({fn.get('arguments') or ''})]"
    text = " ".join(text.split())
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + " ..."
    return f"{role}: {text}" if text else ""


def with_note(messages: list[dict], summary: str) -> list[dict]:
    """The note goes into the one pinned system message (a new one when there is none): the window never
    drops it, and templates that allow a single leading system message (Gemma's) still render."""
    system, turns = window_split(messages)
    note = f"{NOTE_MARK} {summary}"
    if system:
        head = dict(system[0])
        content = head.get("content")
        if isinstance(content, list):
            head["content"] = [*content, {"type": "text", "text": "\n\n" + note}]
        else:
            head["content"] = f"{content or ''}\n\n{note}".lstrip()
    else:
        head = {"role": "system", "content": note}
    return [head, *turns]


class SummaryStore:
    """key -> summary text, least recently used first out."""

    def __init__(self, entries: int = STORE_ENTRIES) -> None:
        self.entries = entries
        self._items: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, text: str) -> None:
        self._items[key] = text
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def longest(self, keys: list[str]) -> tuple[int, str] | None:
        """(i, summary) for the longest prefix turns[:i] with a summary (keys as prefix_keys gives them)."""
        for i in range(len(keys), 0, -1):
            text = self._items.get(keys[i - 1])
            if text is not None:
                self._items.move_to_end(keys[i - 1])
                return i, text
        return None


@dataclass
class _Work:
    summary: str  # the running summary so far ("" from the start)
    lines: list[tuple[str, str]]  # (key of the prefix ending with this turn, the turn's line), oldest first
    skipped: int = 0  # older messages of a huge span left out


@dataclass(frozen=True)
class Windowed:
    prompt: Prompt
    summarized: bool
    messages: list[dict]  # what the prompt renders (with the note), for a continuation on another model


class Models(Protocol):
    """Where the summarizing model comes from: the server's ModelPool, or `simmer chat`'s one engine."""

    def borrow(self, model_id: str) -> AbstractContextManager[Engine | None]:
        """The loaded engine of `model_id`, None when it is not loaded (never loaded for the work)."""
        ...


class Summarizer:
    """The summary window (on the worker thread: `window` per chat job) and its idle work (`pending`,
    `run`). `models()` names the chat models that may write, preferred (smallest) first; none: the plain
    window stays."""

    name = "summary"  # as idle work

    def __init__(
        self,
        models: Callable[[], list[str]],
        *,
        store: SummaryStore | None = None,
        max_tokens: int = SUMMARY_MAX_TOKENS,
        on_step: Callable[[CancelToken], None] | None = None,
        allowed: Callable[[], bool] = lambda: True,
    ) -> None:
        self.models = models
        # The governor's say (app.py: Gate.background): a summary is optional work, and heat, a battery
        # running low or a backgrounded app leave the device alone; the work waits for a better moment.
        self.allowed = allowed
        self.store = store or SummaryStore()
        self.max_tokens = max_tokens
        self.on_step = on_step  # a test seam: called between the summarizer's engine steps
        # greedy: a summary should be the model's most likely reading, not a creative one
        self.sampling = SamplingParams(temperature=0.0)
        self._pending: collections.deque[_Work] = collections.deque(maxlen=PENDING_MAX)
        self._lock = threading.Lock()
        # counters for tests and metrics (never text)
        self.written = 0  # summary pieces stored
        self.preempted = 0  # pieces stopped by a request (resumed at the next idle moment)
        self.failed = 0  # pieces dropped by an error (never retried)
        self.unloaded = 0  # idle moments no summarizing model was loaded (the work waited)
        self.running = False  # inside run() (tests wait for it)

    # -- a request (worker thread, before the reply) --------------------------------------------------
    def window(
        self,
        engine: Engine,
        messages: list[dict],
        *,
        truncate: bool,
        reserve: int,
        tools: ToolUse | None,
        scope: str = "",
    ) -> Windowed:
        """The request's prompt: the plain window, or the window under the summary of the turns it drops
        (found within the request's cache `scope` only); the work for a summary it lacks is queued."""
        prompt = _chat_prompt(engine, messages, truncate=truncate, reserve=reserve, tools=tools)
        plain = Windowed(prompt, False, messages)
        _, turns = window_split(messages)
        n, k = len(turns), prompt.dropped
        # k == n: even the last turn was cut mid-way; a note cannot fit, and it would summarize the
        # question itself. k == 0: nothing dropped (or an engine that does not report it).
        if not prompt.truncated or k <= 0 or k >= n:
            return plain
        keys = prefix_keys(turns[: n - 1], scope)  # the newest turn (the question) is never summarized
        with self._lock:
            found = self.store.longest(keys)
        served, covered, cut = plain, 0, k
        if found is not None:
            j, text = found
            noted = self._noted(engine, messages, turns, j, text, reserve=reserve, tools=tools)
            if noted is None:
                return plain  # the note does not fit this context: more work would not fit either
            served, covered, cut = noted, j, j + noted.prompt.dropped
        if covered < cut:
            self._queue(turns, keys, covered, cut, found[1] if found and covered else "")
        return served

    def dropped(self, messages: list[dict], windowed: Windowed, turns: int, scope: str = "") -> None:
        """After a reply (worker thread): its window dropped `turns` turns of the prompt's messages in all,
        more than before it started (the context filled, or the governor lowered the cap mid-reply). Queue
        their summary as window() queues the turns a request drops: a later request of this conversation
        (which drops at least as many) finds it. Idle work: only the queueing happens here."""
        _, all_turns = window_split(messages)
        _, prompt_turns = window_split(windowed.messages)
        n = len(all_turns)
        cut = n - len(prompt_turns) + turns  # the turns a note stood for, then the ones the window dropped
        if cut <= 0 or cut >= n:
            return
        keys = prefix_keys(all_turns[: n - 1], scope)
        with self._lock:
            found = self.store.longest(keys)  # one that covers more (a look-ahead) stands for them already
        covered, summary = found if found is not None else (0, "")
        if covered < cut:
            self._queue(all_turns, keys, covered, cut, summary)

    def _noted(
        self,
        engine: Engine,
        messages: list[dict],
        turns: list[dict],
        j: int,
        text: str,
        *,
        reserve: int,
        tools: ToolUse | None,
    ) -> Windowed | None:
        """The window over turns[j:] under the summary of turns[:j], or None when the note does not fit
        (too long for this context, or the last turn alone would not fit beside it)."""
        if len(engine.tokenize(text)) > engine.context_length // NOTE_SHARE:
            return None
        system, _ = window_split(messages)
        noted = with_note(system + turns[j:], text)
        try:
            prompt = _chat_prompt(engine, noted, truncate=True, reserve=reserve, tools=tools)
        except SimmerError:
            return None
        if prompt.dropped >= len(turns) - j:
            return None
        # turns were dropped (the summary stands for them) even when the rest now fits whole
        return Windowed(replace(prompt, truncated=True), True, noted)

    def _queue(self, turns: list[dict], keys: list[str], covered: int, cut: int, summary: str) -> None:
        """Work that extends the summary of turns[:covered] past `cut`: to the older half of the kept turns
        (the look-ahead), at a user turn (where a window starts), never the newest turn."""
        n = len(turns)
        target = min(cut + (n - cut) // 2, n - 1)
        while target < n - 1 and turns[target].get("role") != "user":
            target += 1
        if target <= covered:
            return
        span = list(range(covered, target))
        skipped = max(0, len(span) - SPAN_MESSAGES)
        lines = [(keys[i], message_line(turns[i])) for i in span[skipped:]]
        with self._lock:
            if any(w.lines[-1][0] == keys[target - 1] for w in self._pending):
                return  # already queued (the same conversation again before an idle moment)
            self._pending.append(_Work(summary, lines, skipped))
        log.info("summary queued: %d turns (%d skipped)", len(lines), skipped)

    # -- idle work (worker thread, queue empty) ---------------------------------------------------------
    def pending(self) -> bool:
        return bool(self._pending)

    def run(self, pool: Models, cancel: CancelToken) -> None:
        self.running = True
        try:
            self._run(pool, cancel)
        except Exception:  # the summarizing model did not load, or a bug: the worker logs it
            self.failed += 1
            raise
        finally:
            self.running = False

    def _run(self, pool: Models, cancel: CancelToken) -> None:
        candidates = self.models()
        if not candidates:
            with self._lock:
                self._pending.clear()  # no chat model to write it: the plain window stays
            return
        if cancel.cancelled or not self.allowed():
            return
        # Only a loaded model writes (see the module docstring): the smallest loaded one. Loading the smallest
        # in a background thread while the worker takes jobs was the other way, but the load competes with
        # the reply for the device's few cores and memory. Measured on a shared 2-core machine (two runs of 6
        # interleaved rounds): a 48-token Gemma 3 reply
        # decoded while SmolLM2 loaded in a thread took 1.3 and 1.7 s longer (medians), as long as or longer
        # than the load alone (1.2, 1.3 s), the longest a request waits for it on the worker. It would also
        # need room reserved for an in-flight load and a hand-over of the engine to the worker.
        # Waiting keeps one thread owning the models.
        for model_id in candidates:
            with pool.borrow(model_id) as engine:
                if engine is not None:
                    self._drain(engine, cancel)
                    return
        self.unloaded += 1

    def _drain(self, engine: Engine, cancel: CancelToken) -> None:
        while not cancel.cancelled and self.allowed():
            with self._lock:
                if not self._pending:
                    return
                work = self._pending.pop()  # the newest: the conversation most likely to come back
            try:
                self._write(engine, work, cancel)
            except SimmerError as err:  # dropped, never retried (no text in the log)
                self.failed += 1
                log.warning("summary not written: %s", type(err).__name__)

    def _requeue(self, work: _Work) -> None:
        with self._lock:
            if len(self._pending) < PENDING_MAX:
                self._pending.append(work)

    def _write(self, engine: Engine, work: _Work, cancel: CancelToken) -> None:
        # a note may take 1/NOTE_SHARE of a context; half of that keeps it usable by models of half this one's
        max_tokens = max(8, min(self.max_tokens, engine.context_length // (2 * NOTE_SHARE)))
        summary = work.summary
        if work.skipped and not summary:
            summary = f"({work.skipped} earlier messages are not summarized.)"
        while work.lines:
            if not self.allowed():  # the governor's level rose meanwhile: keep what is done, go on later
                work.summary = summary
                self._requeue(work)
                return
            chunk = self._chunk(engine, summary, work.lines, max_tokens)
            text = self._generate(engine, summary, [line for _, line in chunk], cancel, max_tokens)
            if text is None:  # a job arrived: resume from here at the next idle moment
                self.preempted += 1
                work.summary = summary
                self._requeue(work)
                log.info("summary preempted by a request; %d turns left", len(work.lines))
                return
            summary = text or summary
            del work.lines[: len(chunk)]
            if summary:  # a model that says nothing leaves no summary (the plain window stays)
                with self._lock:
                    self.store.put(chunk[-1][0], summary)  # a running summary of every prefix it reached
                self.written += 1
        log.info("summary written (%d stored)", len(self.store))

    def _messages(self, summary: str, lines: list[str]) -> list[dict]:
        # One plain user request, no system message and no labelled empty fields: SmolLM2-135M copied a
        # "Summary so far: (none) / New messages:" layout instead of following it, and wrote a grounded
        # summary for this wording (tried by hand on a few phrasings; a 135M model summarizes poorly at best).
        chat = "\n".join(line for line in lines if line) or "(no text)"
        if summary:
            return [{"role": "user", "content": f"Earlier summary: {summary}\n\nChat:\n{chat}\n\n{UPDATE}"}]
        return [{"role": "user", "content": f"{FIRST}\n\n{chat}"}]

    def _chunk(
        self, engine: Engine, summary: str, lines: list[tuple[str, str]], max_tokens: int
    ) -> list[tuple[str, str]]:
        """The most of `lines` (at least one, clipped by MESSAGE_CHARS) whose prompt leaves room for the
        summary in the summarizer's context: halve until it fits."""
        count = len(lines)
        room = engine.context_length - max_tokens
        while count > 1:
            ids = engine.tokenize(engine.chat_text(self._messages(summary, [x for _, x in lines[:count]])))
            if len(ids) <= room:
                break
            count //= 2
        return lines[:count]

    def _generate(
        self, engine: Engine, summary: str, lines: list[str], cancel: CancelToken, max_tokens: int
    ) -> str | None:
        """The new running summary, or None when `cancel` fired (a job arrived) before it was done."""
        prompt = _chat_prompt(
            engine, self._messages(summary, lines), truncate=True, reserve=max_tokens, tools=None
        )
        params = GenerationParams(sampling=self.sampling, max_tokens=max_tokens, cache_scope=SUMMARY_SCOPE)

        def hook() -> None:
            if self.on_step is not None:
                self.on_step(cancel)
            return None

        text = ""
        for event in engine.generate(prompt, params, cancel=cancel, step_hook=hook):
            if isinstance(event, TokenEvent):
                text += event.text
            elif isinstance(event, FinishEvent):
                if event.finish_reason == "cancelled" or cancel.cancelled:
                    return None
                text += event.text
        return " ".join(text.split())


def _chat_prompt(
    engine: Engine, messages: list[dict], *, truncate: bool, reserve: int, tools: ToolUse | None
) -> Prompt:
    if tools is None:  # engines without tool support keep their two-keyword signature
        return engine.chat_prompt(messages, truncate=truncate, reserve=reserve)
    return engine.chat_prompt(messages, truncate=truncate, reserve=reserve, tools=tools)


def summary_models(
    ladder_models: list[str], default_model: str, can_chat: Callable[[str], bool]
) -> list[str]:
    """The chat models that may write a summary, smallest first (the ladder runs best first); without a
    ladder the served model itself; empty when none can chat."""
    return [m for m in reversed(ladder_models or [default_model]) if can_chat(m)]
