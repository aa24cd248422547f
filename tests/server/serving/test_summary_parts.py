"""The summary window's parts, table by table (no model): the prefix hash chain, how a turn reads to the
summarizer (hostile shapes included), where the note goes, the LRU store, which model writes, and the
governor's say over idle work (on a real tiny model, without HTTP)."""

from __future__ import annotations

import pytest

from models.protocol import EngineLimits, Prompt
from models.types import CancelToken
from server.serving.model_setup import serve_folders
from server.serving.summary import (
    MESSAGE_CHARS,
    NOTE_MARK,
    Summarizer,
    SummaryStore,
    Windowed,
    message_line,
    prefix_keys,
    summary_models,
    with_note,
)
from tests.server.conftest import make_settings
from tests.server.serving.helpers import TEXT_ONLY, conversation

U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "hello"}
U2 = {"role": "user", "content": "more"}
IMAGE = [{"type": "text", "text": "x"}, {"type": "image_url"}]
CALL = [{"function": {"name": "f", "arguments": "{}"}}]


def test_prefix_keys_when_prefix_shared_then_same_keys_and_an_edit_breaks_the_chain():
    a, b = prefix_keys([U1, A1, U2]), prefix_keys([U1, A1, {"role": "user", "content": "other"}])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys([{"role": "user", "content": "HI"}, A1])[1] != a[1]  # the chain: every later key moves
    assert prefix_keys([{"content": "hi", "role": "user"}]) == prefix_keys([U1])  # key order does not matter
    assert prefix_keys([]) == []


@pytest.mark.parametrize(
    ("message", "line"),
    [
        ({"role": "user", "content": ""}, ""),  # empty: nothing to summarize
        ({"role": "user", "content": None}, ""),
        ({"role": "user", "content": "  a\n\n b  "}, "User: a b"),
        (
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]},
            "User: x [image_url]",
        ),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
            },
            "Assistant: [called f({})]",
        ),
        ({"role": "tool", "content": "42", "tool_call_id": "c"}, "Tool: 42"),
        ({"content": "no role"}, "Message: no role"),
        ({"role": "user", "content": ["odd", 3]}, "User: [part] [part]"),
    ],
)
def test_message_line_when_shapes_vary_then_text_only(message, line):
    assert message_line(message) == line


def test_message_line_when_huge_then_clipped():
    line = message_line({"role": "user", "content": "x" * 100_000})
    assert len(line) == len("User: ") + MESSAGE_CHARS + len(" ...")


def test_with_note_when_system_or_not_then_one_pinned_system_message():
    noted = with_note([{"role": "system", "content": "Be brief."}, U1], "S")
    assert noted == [{"role": "system", "content": f"Be brief.\n\n{NOTE_MARK} S"}, U1]
    assert with_note([U1, A1], "S") == [{"role": "system", "content": f"{NOTE_MARK} S"}, U1, A1]
    parts = with_note([{"role": "system", "content": [{"type": "text", "text": "Be"}]}, U1], "S")
    assert parts[0]["content"][-1] == {"type": "text", "text": f"\n\n{NOTE_MARK} S"}


def test_store_when_full_then_least_recently_used_goes_and_longest_prefix_wins():
    store = SummaryStore(entries=2)
    keys = prefix_keys([U1, A1, U2])
    store.put(keys[0], "one")
    store.put(keys[1], "two")
    assert store.longest(keys) == (2, "two")
    assert store.longest(keys[:1]) == (1, "one")  # touched: keys[1] is now the oldest
    store.put("other", "x")
    assert len(store) == 2 and keys[1] not in store and keys[0] in store
    assert store.longest(["nope"]) is None


@pytest.mark.parametrize(
    ("ladder", "chat", "expected"),
    [
        (["big", "small"], {"big", "small"}, ["small", "big"]),  # smallest first: the ladder's last
        (["big", "small", "base"], {"big", "small"}, ["small", "big"]),  # a base model cannot write it
        (["base"], set(), []),
        ([], {"served"}, ["served"]),  # no ladder: the served model itself
        ([], set(), []),
    ],
)
def test_summary_models_table(ladder, chat, expected):
    assert summary_models(ladder, "served", lambda m: m in chat) == expected


def test_summarizer_when_governor_not_calm_then_work_waits(tmp_path, tiny_pair_dirs):
    settings = make_settings(tmp_path, model="tiny-small", context_length=256)
    pool = serve_folders(settings, list(tiny_pair_dirs)).pool
    engine = pool.acquire("tiny-small")
    engine.apply_limits(EngineLimits(context_cap=256))
    pool.release("tiny-small")
    calm = [False]
    summarizer = Summarizer(lambda: ["tiny-small"], allowed=lambda: calm[0])
    summarizer.sampling = TEXT_ONLY
    windowed = summarizer.window(engine, conversation(), truncate=True, reserve=4, tools=None)
    assert windowed.prompt.truncated and not windowed.summarized and summarizer.pending()
    summarizer.run(pool, CancelToken())
    assert summarizer.pending() and summarizer.written == 0  # hot: nothing ran
    calm[0] = True
    summarizer.run(pool, CancelToken())
    assert not summarizer.pending() and summarizer.written >= 1
    assert summarizer.window(engine, conversation(), truncate=True, reserve=4, tools=None).summarized
    cancelled = CancelToken()
    cancelled.cancel()
    summarizer.window(engine, conversation(turns=12), truncate=True, reserve=4, tools=None)
    summarizer.run(pool, cancelled)  # a job already waits: not even started
    assert summarizer.pending() and summarizer.preempted == 0


def dropped_work(stored: int, noted: int, turns_dropped: int) -> tuple[str, list[str]] | None:
    """What Summarizer.dropped queues for conversation(turns=8) (n = 9 turns with the question) when the
    store holds a summary of its first `stored` turns, the prompt carried a note standing for its first
    `noted` turns, and the reply's window had dropped `turns_dropped` of the prompt's turns when it ended."""
    messages = conversation(turns=8)
    turns = messages[1:]
    keys = prefix_keys(turns[:-1])
    summarizer = Summarizer(lambda: ["m"])
    if stored:
        summarizer.store.put(keys[stored - 1], f"first {stored}")
    shown = with_note([messages[0], *turns[noted:]], f"first {noted}") if noted else messages
    summarizer.dropped(messages, Windowed(Prompt([0]), bool(noted), shown), turns_dropped)
    if not summarizer.pending():
        return None
    (work,) = summarizer._pending
    first = turns.index(next(t for t in turns if message_line(t) == work.lines[0][1]))
    assert [key for key, _ in work.lines] == keys[first : first + len(work.lines)]
    return work.summary, [f"turn {i}" for i in range(first, first + len(work.lines))]


@pytest.mark.parametrize(
    ("stored", "noted", "turns_dropped", "summary", "span"),
    [
        # dropped mid-reply, no summary yet: turns 0..3 dropped, the look-ahead reaches turn 6 (a user turn)
        (0, 0, 4, "", range(0, 6)),
        # the prompt's note stood for 2 turns, the reply dropped 2 more of its own: extend the summary of 2
        (2, 2, 2, "first 2", range(2, 6)),
        # a summary of more than was dropped exists already (the request's look-ahead): nothing to do
        (6, 0, 4, None, None),
        # nothing, or everything (even the question) dropped: no work
        (0, 0, 0, None, None),
        (0, 0, 9, None, None),
    ],
)
def test_summarizer_dropped_when_the_reply_window_drops_turns_then_their_work_queued(
    stored, noted, turns_dropped, summary, span
):
    expected = None if summary is None else (summary, [f"turn {i}" for i in span])
    assert dropped_work(stored, noted, turns_dropped) == expected
