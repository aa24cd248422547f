"""The model ladder against the first model's variants alone and against no governor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.sustained.audit import install_socket_audit, summarize_audit
from bench.sustained.client import ENDPOINTS, MAX_TOKENS
from bench.sustained.measure import WARM_SPAN, envelope, growth
from bench.sustained.plot import plot_runs
from bench.sustained.run import bench_settings, run_each
from server.settings import Settings

LADDER_TARGETS = {"tok_s_ratio": 2.0, "peak_over_throttle_c": 1.0, "growth_mb": 5.0}


WARM_KEY = f"ladder_memory_growth_mb_once_warm ({WARM_SPAN} requests after every model in use served once)"


def ladder_runs(ladder: str) -> list[tuple[str, dict[str, Any]]]:
    """The ladder benchmark's three configurations, each on its own cold device: governed with the ladder,
    governed on the first model's variants alone, ungoverned (the first model at full speed)."""
    first = ladder.split(",")[0].split(":")[0].strip()
    return [
        ("ladder", {"governor": True, "ladder": ladder, "model": first}),
        ("variants", {"governor": True, "ladder": None, "model": first}),
        ("ungoverned", {"governor": False, "ladder": None, "model": first}),
    ]


def bench_ladder(
    settings: Settings,
    ladder: str,
    *,
    endpoint: str = "completions",
    profile: str = "phone",
    minutes: float = 10.0,
    time_scale: float = 10.0,
    model_dir: Path | None = None,
    plot: str | None = None,
) -> dict[str, Any]:
    """The ladder benchmark: the ladder across models against variants alone and against no governor, in
    one run, each configuration on the same simulated device starting cold. Requests name the ladder's
    first model (a client asks for the best one; the governor places the reply on its rung)."""
    client_audit: list[str] = []
    install_socket_audit(client_audit.append)
    base = bench_settings(settings, profile, time_scale, log_level="info")  # info: the moves are logged
    load_start = os.getloadavg()
    configs = ladder_runs(ladder)
    runs, audits = run_each(
        base, configs, minutes=minutes, time_scale=time_scale, model_dir=model_dir, endpoint=endpoint
    )
    report = {
        "benchmark": "sustained-ladder",
        "profile": profile,
        "minutes": minutes,
        "time_scale": time_scale,
        "ladder": ladder,
        "endpoint": ENDPOINTS[endpoint],
        "max_tokens_per_request": MAX_TOKENS,
        # a busy machine starves the server of CPU, and a server that cannot run cannot heat the device
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1_5_15_start": [round(x, 2) for x in load_start],
            "loadavg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
        },
        "targets": ladder_targets(runs),
        "summary": {name: ladder_summary(run) for name, run in runs.items()},
        "offline": {
            "ok": summarize_audit(audits)["offline_ok"] and summarize_audit(client_audit)["offline_ok"],
        },
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in runs.items()},
        "series": {k: v["series"] for k, v in runs.items()},
    }
    report["envelope"] = envelope(profile, runs, governed="ladder")
    if plot:
        plot_runs(
            runs,
            plot,
            profile=profile,
            time_scale=time_scale,
            title="the ladder, its first model's variants, ungoverned",
        )
        report["plot"] = plot
    return report


def ladder_summary(run: dict[str, Any]) -> dict[str, Any]:
    """One configuration's numbers for the ladder benchmark."""
    rss = run["rss_mb"]
    moves = run.get("moves") or {}
    peak, throttle = run["peak_temperature_c"], run["throttle_c"]
    return {
        "tok_s_last_5min": run["tok_s_last_5min"],
        "tok_s_mean": run["tok_s_mean"],
        "peak_temperature_c": peak,
        "throttle_c": throttle,
        "peak_minus_throttle_c": None if peak is None or throttle is None else round(peak - throttle, 2),
        "device_kills": run["device_kills"],
        "requests": run["requests"],
        "failed_requests": run["failed_requests"],
        "failures": run["failures"],
        "tokens_per_model": run["tokens_per_model"],
        "models_seconds": run["models_seconds"],
        "levels_seconds": run["levels_seconds"],
        "rung_moves": moves.get("rung_moves"),
        "replies_moved": moves.get("replies_moved"),
        "unloads": moves.get("unloads"),
        "rss_mb": rss,
        # cold: from request 1, while a ladder run may still be building its second model's sessions
        "memory_growth_mb_1_to_10_requests": growth(rss["after_10_requests"], rss["after_1_request"]),
        "memory_growth_mb_10_to_20_requests": growth(rss["after_20_requests"], rss["after_10_requests"]),
        "memory_once_warm": run.get("memory_once_warm"),
    }


def ladder_targets(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ladder benchmark's targets, on the ladder configuration (the ratio against the ungoverned one)."""
    lad, ung = runs["ladder"], runs["ungoverned"]
    ratio = lad["tok_s_last_5min"] / ung["tok_s_last_5min"] if ung["tok_s_last_5min"] else None
    peak, throttle = lad["peak_temperature_c"], lad["throttle_c"]
    cold = growth(lad["rss_mb"]["after_10_requests"], lad["rss_mb"]["after_1_request"])
    once_warm = lad.get("memory_once_warm") or {}
    warm = once_warm.get("growth_mb")
    span = once_warm.get("requests_after_warm") or 0  # a short run measures fewer: not judged
    t = LADDER_TARGETS
    return {
        "ladder_over_ungoverned_tok_s_last_5min": round(ratio, 3) if ratio else None,
        "variants_over_ungoverned_tok_s_last_5min": round(
            runs["variants"]["tok_s_last_5min"] / ung["tok_s_last_5min"], 3
        )
        if ung["tok_s_last_5min"]
        else None,
        f"tok_s_ratio_ok (>= {t['tok_s_ratio']:g})": bool(ratio and ratio >= t["tok_s_ratio"]),
        f"ladder_peak_below_throttle_plus_{t['peak_over_throttle_c']:g}": bool(
            peak is not None and throttle is not None and peak < throttle + t["peak_over_throttle_c"]
        ),
        "ladder_zero_failed": lad["failed_requests"] == 0,
        "ladder_memory_growth_mb_cold (rss after request 10 - after request 1)": cold,
        WARM_KEY: warm,
        "ladder_memory_requests_after_warm": span,
        f"memory_growth_ok (<= {t['growth_mb']:g} MB once warm)": warm is not None
        and span >= WARM_SPAN
        and warm <= t["growth_mb"],
    }
