"""What a run measured: tok/s and goodput per simulated second, temperatures, TTFT, memory once warm,
CPU and the thermal envelope's limit."""

from __future__ import annotations

import collections
import statistics
from typing import Any

from bench.sustained.client import RequestRecord, RunLog

WARM_UP_S = 120  # simulated seconds from cold before "no mid-reply pause" is asked of the governor


LEVEL_INDEX = {"nominal": 0, "fair": 1, "serious": 2, "critical": 3}


WARM_SPAN = 10  # requests over which memory growth once warm is measured


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (no interpolation: a value some request really had)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def _cpu_between(cpu: list[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Server CPU seconds spent between two simulated times (from the sampler's readings)."""
    inside = [c for t, c in cpu if start_s <= t <= end_s]
    return inside[-1] - inside[0] if len(inside) >= 2 else 0.0


def energy_summary(
    log: RunLog, tok_s: list[float], total_s: int, time_scale: float, t0: float
) -> dict[str, Any]:
    """Tokens per CPU-second of the server (whole run and last 5 minutes), its mean busy cores over the
    last 5 minutes, and the pauses a user saw mid-reply. tok_s holds, per simulated second, tokens per wall
    second: its sum over a window is tokens * time_scale."""
    window = min(300, total_s)
    start = total_s - window
    tokens_all = sum(tok_s) / time_scale
    tokens_last = sum(tok_s[start:]) / time_scale
    good = goodput_per_s(log, total_s, time_scale, t0)
    good_all = sum(good) / time_scale
    cpu_all = _cpu_between(log.cpu, 0, total_s)
    cpu_last = _cpu_between(log.cpu, start, total_s)
    return {
        "server_cpu_s": round(cpu_all, 2),
        "tok_per_cpu_s": round(tokens_all / cpu_all, 2) if cpu_all > 0 else None,
        "tok_per_cpu_s_last_5min": round(tokens_last / cpu_last, 2) if cpu_last > 0 else None,
        # tokens of replies that completed per CPU-second: what the CPU bought that a user got
        "goodput_per_cpu_s": round(good_all / cpu_all, 2) if cpu_all > 0 else None,
        "busy_cores_last_5min": round(cpu_last / (window / time_scale), 3) if window else None,
        "mid_reply_pauses": sum(r.pauses for r in log.requests),
        "mid_reply_pauses_after_warm_up": sum(
            1 for r in log.requests for t in r.pause_times if (t - t0) * time_scale >= WARM_UP_S
        ),
        "replies_paused": sum(1 for r in log.requests if r.pauses),
        "paused_seconds": sum(1 for s in log.samples if s.get("paused")),
    }


def goodput_per_s(log: RunLog, total_s: int, time_scale: float, t0: float) -> list[float]:
    """Per simulated second, tokens of replies that completed (a reply still running at the end of the run
    counts: nothing failed it), as tokens per wall second like tok_s. A failed reply's tokens count for
    nothing: they were sent, but no user got an answer."""
    per_s = [0] * total_s
    for rec in log.requests:
        if not rec.ok:
            continue
        for t in rec.token_times:
            i = int((t - t0) * time_scale)
            if 0 <= i < total_s:
                per_s[i] += 1
    return [n * time_scale for n in per_s]


def envelope(profile: str, runs: dict[str, dict[str, Any]], governed: str = "governed") -> dict[str, Any]:
    """The thermal envelope's limit for the profile and the governed run's efficiency against it, both in
    goodput: tokens of replies that completed (a run whose replies fail sends tokens nobody gets)."""
    from governor.thermal_sim import get_profile

    cores = get_profile(profile).sustainable_cores()
    measured = {name: r["goodput_per_cpu_s"] for name, r in runs.items() if r.get("goodput_per_cpu_s")}
    if not measured:
        return {"sustainable_cores_at_t_throttle": round(cores, 3), "limit_tok_s": None, "efficiency": None}
    best_run = max(measured, key=lambda name: measured[name])
    limit = cores * measured[best_run]
    g = runs.get(governed, {})
    good = g.get("goodput_tok_s_last_5min")
    efficiency = good / limit if good is not None and limit else None
    return {
        "sustainable_cores_at_t_throttle": round(cores, 3),
        "best_goodput_per_cpu_s": measured[best_run],
        "best_goodput_per_cpu_s_run": best_run,
        "limit_tok_s": round(limit, 2),
        "governed_goodput_tok_s_last_5min": good,
        "governed_tok_s_last_5min": g.get("tok_s_last_5min"),
        "efficiency": round(efficiency, 3) if efficiency is not None else None,
        "how": "limit = busy cores the simulated device sustains at T_throttle (steady state, leakage "
        "included) x the best server goodput per CPU-second measured in this benchmark (tokens of replies "
        "that completed); efficiency = governed goodput tok/s over the last 5 minutes / limit",
    }


def summarize(
    log: RunLog, meta: dict[str, Any], *, time_scale: float, minutes: float, sample_every_sim_s: float = 1.0
) -> dict[str, Any]:
    t0 = meta["t0"]
    total_s = int(minutes * 60)
    # tokens per simulated second, as real tok/s (tokens in that 1/time_scale wall-second window)
    per_s = [0] * total_s
    for t in log.token_times:
        i = int((t - t0) * time_scale)
        if 0 <= i < total_s:
            per_s[i] += 1
    tok_s = [n * time_scale for n in per_s]
    last5 = tok_s[-300:] if total_s >= 300 else tok_s
    good = goodput_per_s(log, total_s, time_scale, t0)
    good5 = good[-300:] if total_s >= 300 else good
    # within the run (an open-loop run waits past its end for requests still queued)
    temps = [s["temperature"] for s in log.samples if s["temperature"] is not None and s["t"] < total_s]
    throttle = next((s["throttle_c"] for s in log.samples if s["throttle_c"]), None)
    critical = next((s["critical_c"] for s in log.samples if s["critical_c"]), None)
    above = sum(1 for s in log.samples if throttle is not None and (s["temperature"] or 0) >= throttle)
    ttfts = [r.ttft_s for r in log.requests if r.ttft_s is not None]
    failed = [r for r in log.requests if not r.ok]
    served = [r.served for r in log.requests if r.served]
    series = []
    by_second: dict[int, dict] = {}
    for s in log.samples:
        by_second.setdefault(int(s["t"]), s)
    last = None
    for sec in range(total_s):
        # a sparser sampler (the offload runs) leaves seconds out: they hold the last sample (step-like)
        s = by_second.get(sec) or (last if sec > 0 and sample_every_sim_s > 1 else None)
        last = s or last
        series.append(
            {
                "t": sec,
                "temperature": s["temperature"] if s else None,
                "level": s["level"] if s else None,
                "variant": s["variant"] if s else None,
                "model": s.get("model") if s else None,
                "threads": s["limit_threads"] if s else None,
                "cpu_budget_cores": s.get("cpu_budget_cores") if s else None,
                "pace_tok_s": s.get("pace_tok_s") if s else None,
                "tok_s": tok_s[sec],
            }
        )
    return {
        "requests": len(log.requests),
        "failed_requests": len(failed),
        "failures": sorted({r.error or "?" for r in failed})[:5],
        "total_tokens": sum(r.tokens for r in log.requests),
        "tok_s_mean": round(sum(tok_s) / max(1, len(tok_s)), 2),
        "tok_s_last_5min": round(sum(last5) / max(1, len(last5)), 2),
        "goodput_tok_s_last_5min": round(sum(good5) / max(1, len(good5)), 2),
        "peak_temperature_c": round(max(temps), 2) if temps else None,
        "start_temperature_c": round(temps[0], 2) if temps else None,
        "end_temperature_c": round(temps[-1], 2) if temps else None,
        "throttle_c": throttle,
        "critical_c": critical,
        "seconds_above_throttle": above,
        "device_kills": meta["kills"],
        "reached_critical": bool(temps and critical is not None and max(temps) >= critical),
        "ttft_ms_median": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_ms_p95": round(percentile(ttfts, 95) * 1000, 1) if ttfts else None,
        "served_upstream_share": round(served.count("upstream") / len(served), 3) if served else None,
        "routes": dict(
            sorted(collections.Counter(f"{r.served}/{r.reason}" for r in log.requests if r.served).items())
        ),
        "mean_temperature_c": round(statistics.fmean(temps), 2) if temps else None,
        "ttft_ms_first": round(log.requests[0].ttft_s * 1000, 1)
        if log.requests and log.requests[0].ttft_s
        else None,
        "cold_start_s": meta["cold_start_s"],
        "rss_mb": {
            "ready": round(log.rss_ready / 2**20, 1),
            "after_1_request": _mb(log.rss_after.get(1)),
            "after_10_requests": _mb(log.rss_after.get(10)),
            "after_20_requests": _mb(log.rss_after.get(20)),
        },
        "memory_once_warm": warm_memory(log.requests, log.rss_after),
        "tokens_per_model": tokens_per_model(log.requests),
        "moves": meta.get("moves"),
        **energy_summary(log, tok_s, total_s, time_scale, t0),
        "levels_seconds": {lv: sum(1 for s in series if s["level"] == lv) for lv in LEVEL_INDEX},
        "variants_seconds": {
            v: sum(1 for s in series if s["variant"] == v)
            for v in sorted({s["variant"] for s in series if s["variant"]})
        },
        "models_seconds": {
            m: sum(1 for s in series if s.get("model") == m)
            for m in sorted({s["model"] for s in series if s.get("model")})
        },
        "series": series,
    }


def tokens_per_model(requests: list[RequestRecord]) -> dict[str, int]:
    """Tokens each model produced over the run (the replies' usage.models)."""
    out: dict[str, int] = {}
    for rec in requests:
        for model, n in rec.models.items():
            out[model] = out.get(model, 0) + int(n)
    return dict(sorted(out.items()))


def warm_memory(
    requests: list[RequestRecord], rss_after: dict[int, int], span: int = WARM_SPAN
) -> dict[str, Any]:
    """The server's RSS growth once warm: over the `span` requests after the first request by which every
    model the run used had served once (its sessions built). Counting from request 1 instead (the cold
    number, rss_mb after_1/after_10) counts the second model's load in a ladder run as growth. A model
    unloaded or loaded again inside the window still shows (as it should: that is memory the device sees);
    `rss_mb_window` lists every request's RSS so a reader can tell a load from a creep."""
    in_use = {m for r in requests for m, n in r.models.items() if n}
    seen: set[str] = set()
    warm = None
    for i, rec in enumerate(requests, 1):
        seen |= {m for m, n in rec.models.items() if n}
        if in_use and seen >= in_use:
            warm = i
            break
    out: dict[str, Any] = {"models_in_use": sorted(in_use), "warm_after_request": warm}
    if warm is None or warm not in rss_after:
        return {**out, "requests_after_warm": 0, "growth_mb": None}
    end = max((k for k in rss_after if warm < k <= warm + span), default=warm)
    window = [rss_after[k] for k in range(warm, end + 1) if k in rss_after]
    return {
        **out,
        "requests_after_warm": end - warm,
        "rss_mb_warm": _mb(rss_after[warm]),
        "rss_mb_end": _mb(rss_after[end]),
        "growth_mb": None if end == warm else growth(_mb(rss_after[end]), _mb(rss_after[warm])),
        "rss_mb_window": [_mb(x) for x in window],
        "how": f"RSS after request warm_after_request + {span} (or the run's last) minus RSS after request "
        "warm_after_request: the first request by which every model that served in this run had served once",
    }


def growth(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 1)
