"""`simmer bench governor-moves`: what the governor's own moves cost a running reply.

A thread change: one client streams a long reply; a second later the app reports it is in the background
(`POST /v1/lifecycle`, with SIMMER_BACKGROUND_ACTION=low_priority: the governor lowers the threads and
paces the reply, it does not pause it). The new thread count needs another onnxruntime session. Measured
twice in the same run: with room for that session beside the running one (it is built on the session-build
thread while the reply goes on) and with a memory budget that leaves none (built inside the reply, as every
build was before). Reported: the reply's longest gap between two tokens after the move, against the median
gap of its last half (the new configuration's own pace), and /v1/thermal's `session_builds` counts, which
say which path ran.

A step up: a ladder BIG,SMALL starts in the background (the governor on SMALL's rung); a reply streams on
SMALL, and the app comes back to the foreground: once the governor's dwell is over it steps up, BIG loads
beside the worker and the reply hands over to it mid-way. Reported: the longest gap around the hand-over
against the median gap before it (SMALL's) and after it (BIG's).
"""

from __future__ import annotations

import itertools
import re
import statistics
import threading
import time
from typing import Any

import httpx

from bench.cold_start import token_times
from bench.embed_bench import cpu_class
from bench.sustained.process import server_process
from models.store.store import ModelStore
from server.settings import Settings

CLIENT = "bench"
# the server's log lines that say what a move did
_MOVES = re.compile(r"applying governor limits|no room to build|the governor moves the reply| -> \S+/\S+: ")


def _lifecycle(url: str, state: str) -> None:
    httpx.post(url + "/v1/lifecycle", json={"state": state, "client": CLIENT}, timeout=30).raise_for_status()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _median(gaps: list[float]) -> float | None:
    return statistics.median(gaps) if gaps else None


def _builds(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/thermal", timeout=10).json().get("session_builds", {})


def _stream_with_move(url: str, model: str, max_tokens: int, move: str, after_s: float) -> tuple[list, float]:
    """(token arrival times, when `move` was reported): the stream runs in a thread, the move at after_s."""
    times: list[float] = []
    stream = threading.Thread(target=token_times, args=(url, model, max_tokens, times))
    stream.start()
    time.sleep(after_s)
    moved = time.monotonic()
    _lifecycle(url, move)
    stream.join()
    return times, moved


def thread_change(settings: Settings, model: str, max_tokens: int, budget_mb: int | None) -> dict[str, Any]:
    update: dict[str, Any] = {"memory_budget_mb": budget_mb} if budget_mb else {}
    with server_process(settings.model_copy(update=update)) as srv:
        token_times(srv.url, model, 16, [])  # warm
        before = _builds(srv.url)
        level = httpx.get(srv.url + "/v1/thermal", timeout=10).json().get("level")
        times, moved = _stream_with_move(srv.url, model, max_tokens, "background", 1.5)
        after = _builds(srv.url)
        _lifecycle(srv.url, "foreground")
        logged = [line.split(": ", 2)[-1] for line in srv.log_lines() if _MOVES.search(line)]
    pairs = [(a, b) for a, b in itertools.pairwise(times) if b > moved]
    gaps_after = [b - a for a, b in pairs]
    settled = gaps_after[len(gaps_after) // 2 :]
    worst, median = (max(gaps_after) if gaps_after else None), _median(settled)
    at = pairs[gaps_after.index(worst)][0] - moved if worst is not None else None
    return {
        "memory_budget_mb": budget_mb,
        "level_before_move": level,
        "tokens": len(times),
        "median_gap_before_ms": _ms(_median([b - a for a, b in itertools.pairwise(times) if b <= moved])),
        "median_gap_after_ms": _ms(median),
        "max_gap_after_move_ms": _ms(worst),
        "max_over_median": round(worst / median, 2) if worst and median else None,
        "max_gap_begins_s_after_move": None if at is None else round(at, 2),
        "session_builds": {k: after.get(k, 0) - before.get(k, 0) for k in ("beside", "inside")},
        "logged": logged[-6:],
    }


def no_room_budget_mb(settings: Settings, model: str) -> int:
    """A budget that holds the model loaded but not a second session of its weights (the memory plan's
    test: its weights once more within what the budget leaves): the model's resident estimate as /api/ps
    shows it, plus nine tenths of its weights, which keeps over a fifth of the budget free (the governor's
    memory level stays nominal, so the move is the lifecycle's alone)."""
    with server_process(settings) as srv:
        token_times(srv.url, model, 4, [])
        ps = httpx.get(srv.url + "/api/ps", timeout=10).json()["models"]
    size = next(m["size"] for m in ps if m["name"].split(":")[0] == model)
    manifest = ModelStore(settings.home).load(model).manifest
    weights = manifest["variants"][manifest["default_variant"]]["weights_bytes"]
    return int((size + 0.9 * weights) / 2**20)


def step_up(settings: Settings, big: str, small: str, max_tokens: int) -> dict[str, Any]:
    update = {"ladder": f"{big},{small}", "model": big}
    with server_process(settings.model_copy(update=update)) as srv:
        _lifecycle(srv.url, "background")  # the governor on the small rung; the big one unloads when idle
        token_times(srv.url, big, 4, [])
        before = _builds(srv.url)
        times, moved = _stream_with_move(srv.url, big, max_tokens, "foreground", 1.5)
        switches = [line.split(": ", 2)[-1] for line in srv.log_lines() if _MOVES.search(line)]
        after = _builds(srv.url)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    after_move = [g for (a, b), g in zip(itertools.pairwise(times), gaps, strict=True) if b > moved]
    worst = max(after_move) if after_move else None
    before_gaps = [g for (a, b), g in zip(itertools.pairwise(times), gaps, strict=True) if b <= moved]
    last = after_move[len(after_move) // 2 :]
    return {
        "tokens": len(times),
        "median_gap_small_ms": _ms(_median(before_gaps)),
        "median_gap_last_half_ms": _ms(_median(last)),
        "max_gap_after_foreground_ms": _ms(worst),
        "max_over_small_median": round(worst / _median(before_gaps), 2) if worst and before_gaps else None,
        "logged": switches[-6:],
        "session_builds": {k: after.get(k, 0) - before.get(k, 0) for k in ("beside", "inside")},
    }


def bench_governor_moves(
    settings: Settings, *, model: str, small: str | None, rounds: int, max_tokens: int
) -> dict[str, Any]:
    base = settings.model_copy(
        update={
            "model": model,
            "ladder": None,
            "stream_interval_ms": 0,
            "max_batch": 1,
            "background_action": "low_priority",
            "thermal_source": "none",
            "keep_alive_s": -1.0,
            "log_level": "info",
            "api_key": None,
            "summary": False,
        }
    )
    tight = no_room_budget_mb(base, model)
    changes: dict[str, list[dict[str, Any]]] = {"beside": [], "inside": []}
    for i in range(rounds):
        order = [("beside", None), ("inside", tight)]
        for name, budget in order[i % 2 :] + order[: i % 2]:
            changes[name].append(thread_change(base, model, max_tokens, budget))
    # the small rung streams fast and the governor steps up only after its dwell: a longer reply
    ups = [step_up(base, model, small, max(max_tokens, 1500)) for _ in range(rounds)] if small else []

    def med(runs: list[dict[str, Any]], key: str) -> float | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return round(statistics.median(xs), 2) if xs else None

    return {
        "benchmark": "governor-moves",
        "cpu_class": cpu_class(),
        "model": model,
        "threads": settings.threads,
        "max_tokens": max_tokens,
        "thread_change": {
            name: {"max_over_median": med(runs, "max_over_median"), "runs": runs}
            for name, runs in changes.items()
        },
        "step_up": {"small": small, "max_over_small_median": med(ups, "max_over_small_median"), "runs": ups},
    }
