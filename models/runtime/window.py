"""The chat sliding window's turns: what it pins, what it drops, and where a window may start.

Used twice by the engine: before a reply (chat_prompt with truncate: the newest turns that fit with room for
the answer) and during one (the context filled, or the governor lowered the cap mid-reply: the newest turns
that fit with the reply so far), so both drop whole turns the same way and a summary of the dropped turns
(server/serving/summary.py) keys on the same count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.types import ToolUse


def window_split(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """The sliding window's two parts: the pinned system message (the first one, if any) and the turns it
    drops from the front (every other message, in order)."""
    system = [m for m in messages if m.get("role") == "system"][:1]
    return system, [m for m in messages if m not in system]


@dataclass
class TurnWindow:
    """A chat reply's context as whole turns, so a window that slides mid-reply drops turns, not tokens:
    ctx[:head] renders `messages` without their first `dropped` turns, ctx[head:] is the reply so far."""

    messages: list[dict]
    tools: ToolUse | None
    dropped: int
    head: int


def newest_turns(
    turns: list[dict], first: int, encode: Callable[[int], list[int]], fits: Callable[[list[int]], bool]
) -> tuple[tuple[int, list[int]] | None, list[int] | None]:
    """((start, encode(start)) for the earliest window start >= first that fits, or None; and the
    encoding of the last start tried that did not fit). A window starts with a user turn, as chats do, or
    is the last turn alone. Fewer turns never make a longer prompt, so the start is found by bisection: a
    history of thousands of turns costs a few dozen encodings, not one per turn (which made a 1 MB body
    hold the worker for minutes)."""
    n = len(turns)
    starts = [i for i in range(max(first, 1), n - 1) if turns[i].get("role") == "user"]
    if n > 1 and n - 1 >= first:
        starts.append(n - 1)
    lo, hi = 0, len(starts) - 1
    best: tuple[int, list[int]] | None = None
    failed: list[int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = encode(starts[mid])
        if fits(candidate):
            best, hi = (starts[mid], candidate), mid - 1
        else:
            lo, failed = mid + 1, candidate
    return best, failed
