"""Governed against ungoverned (and the level table alone, with `levels`), and offload against no offload."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from bench.sustained.audit import install_socket_audit, summarize_audit
from bench.sustained.client import MAX_TOKENS
from bench.sustained.measure import envelope, growth, summarize
from bench.sustained.plot import plot_runs
from bench.sustained.process import server_process
from bench.sustained.run import bench_settings, run_each, run_once
from server.settings import Settings

SPARSE_SAMPLE_S = 0.5  # wall seconds between device samples in the offload runs


def bench_sustained(
    settings: Settings,
    *,
    profile: str = "phone",
    minutes: float = 10.0,
    time_scale: float = 10.0,
    plot: str | None = None,
    model_dir: Path | None = None,
    levels: bool = False,
    upstream: str | None = None,
    arrival_every_s: float = 60.0,
) -> dict[str, Any]:
    """Governed vs ungoverned on `sim:profile`; returns the JSON report (series included per second).
    levels=True adds a third run, "levels": governed by the level table alone (pace control off, pausing at
    T_throttle), the governor the pace controller replaced.
    With `upstream` (a base URL, or "spawn" for a second simmer started here): offload vs no offload."""
    client_audit: list[str] = []
    install_socket_audit(client_audit.append)
    base = bench_settings(settings, profile, time_scale)
    if upstream:
        return bench_offload(
            base,
            upstream,
            profile=profile,
            minutes=minutes,
            time_scale=time_scale,
            plot=plot,
            model_dir=model_dir,
            arrival_every_s=arrival_every_s,
        )
    runs, audits = run_each(base, _runs(levels), minutes=minutes, time_scale=time_scale, model_dir=model_dir)
    g, u = runs["governed"], runs["ungoverned"]
    throttle = g["throttle_c"]
    rss = g["rss_mb"]
    server_audit = summarize_audit(audits)
    client_side = summarize_audit(client_audit)
    report = {
        "benchmark": "sustained",
        "profile": profile,
        "minutes": minutes,
        "time_scale": time_scale,
        "model": settings.model,
        "max_tokens_per_request": MAX_TOKENS,
        "targets": {
            **governed_over_ungoverned(g, u),
            "governed_peak_below_throttle_plus_1": bool(
                throttle is not None
                and g["peak_temperature_c"] is not None
                and g["peak_temperature_c"] < throttle + 1
            ),
            "governed_never_critical": not g["reached_critical"] and not g["device_kills"],
            "governed_zero_failed": g["failed_requests"] == 0,
        },
        "acceptance": {
            "cold_start_s (spawn to /health ok, imports included)": g["cold_start_s"],
            "ttft_ms_first_request": g["ttft_ms_first"],
            "ttft_ms_median": g["ttft_ms_median"],
            "memory_growth_mb_after_10_requests (rss after 10 - after 1)": growth(
                rss["after_10_requests"], rss["after_1_request"]
            ),
            "memory_growth_mb_ready_to_10_requests": growth(rss["after_10_requests"], rss["ready"]),
            "temperature_rise_c_governed (peak - start)": _rise(g),
            "temperature_rise_c_ungoverned (peak - start)": _rise(u),
            "offline": {
                "ok": server_audit["offline_ok"] and client_side["offline_ok"],
                "how": "Python audit hooks (PEP 578) in the server process and in this client recorded every "
                "socket bind/connect/sendto/getaddrinfo; none had a non-loopback address",
                "server": server_audit,
                "client": client_side,
            },
        },
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in runs.items()},
        "series": {k: v["series"] for k, v in runs.items()},
    }
    report["envelope"] = envelope(profile, runs)
    report["targets"].update(pace_targets(runs, report["envelope"]))
    if plot:
        plot_runs(runs, plot, profile=profile, time_scale=time_scale)
        report["plot"] = plot
    return report


def governed_over_ungoverned(g: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    """The governed run against the ungoverned one over the last 5 minutes, in goodput, not tokens sent: an
    ungoverned device that streams and then dies mid-reply (killed, or refusing once hot) completes
    nothing, and what it sent before failing is no work done. The ratio is None when the ungoverned run
    completed no reply at all (the governed one then wins if it completed any)."""
    good_g, good_u = g["goodput_tok_s_last_5min"], u["goodput_tok_s_last_5min"]
    ratio = good_g / good_u if good_u else None
    sent = g["tok_s_last_5min"] / u["tok_s_last_5min"] if u["tok_s_last_5min"] else None
    return {
        "governed_over_ungoverned_goodput_last_5min": round(ratio, 3) if ratio is not None else None,
        "governed_over_ungoverned_tok_s_sent_last_5min": round(sent, 3) if sent else None,
        "goodput_ratio_ok (>= 1.2)": bool(good_g > 0 and (ratio is None or ratio >= 1.2)),
    }


def _runs(levels: bool) -> list[tuple[str, dict[str, Any]]]:
    runs: list[tuple[str, dict[str, Any]]] = [
        ("governed", {"governor": True}),
        ("ungoverned", {"governor": False}),
    ]
    if levels:
        runs.append(("levels", {"governor": True, "pace_control": False}))
    return runs


def pace_targets(runs: dict[str, dict[str, Any]], env: dict[str, Any]) -> dict[str, Any]:
    """The pace controller's targets: no mid-reply pause after warm-up, at least the pausing
    governor's tok/s (when that run was made), efficiency >= 0.95 against the envelope's limit."""
    g = runs["governed"]
    out: dict[str, Any] = {
        "governed_no_mid_reply_pause_after_warm_up": g["mid_reply_pauses_after_warm_up"] == 0,
        "efficiency_vs_envelope_limit": env.get("efficiency"),
        "efficiency_ok (>= 0.95)": bool(env.get("efficiency") and env["efficiency"] >= 0.95),
    }
    if "levels" in runs:
        out["governed_tok_s_at_least_levels"] = g["tok_s_mean"] >= runs["levels"]["tok_s_mean"]
    return out


def _rise(run: dict[str, Any]) -> float | None:
    if run["peak_temperature_c"] is None or run["start_temperature_c"] is None:
        return None
    return round(run["peak_temperature_c"] - run["start_temperature_c"], 2)


def bench_offload(
    base: Settings,
    upstream: str,
    *,
    profile: str,
    minutes: float,
    time_scale: float,
    plot: str | None,
    model_dir: Path | None,
    arrival_every_s: float = 60.0,
) -> dict[str, Any]:
    """The same governed device twice, from cold: once keeping everything local (SIMMER_ROUTE=local), once
    offloading (SIMMER_ROUTE=auto) to `upstream`. Only the device's own process heats the simulated device;
    the upstream stands for a machine elsewhere (here it shares this machine's CPU: a conservative setup).

    Requests arrive open loop, one every `arrival_every_s` simulated seconds: offloading is for *new* work
    (a reply already running stays where it started), and a closed-loop client would sit behind one reply
    paused mid-way and send nothing new while the device is hot."""
    runs: dict[str, dict[str, Any]] = {}
    # Sampling the device costs the device CPU (it heats it): twice a wall second at most here, since a
    # heatwave phone idles only 0.6 C below where the governor leaves critical.
    sample_wall_s = max(1.0 / time_scale, SPARSE_SAMPLE_S)
    with contextlib.ExitStack() as stack:
        if upstream == "spawn":
            key = base.upstream_api_key.get_secret_value() if base.upstream_api_key else None
            up_settings = base.model_copy(
                update={"thermal_source": "none", "route": "local", "upstream_url": None, "api_key": key}
            )
            up = stack.enter_context(server_process(up_settings, model_dir=model_dir))
            url, where = up.url + "/v1", "a second simmer on this machine (spawned)"
        else:
            url, where = upstream, upstream
        for name, update in (
            ("no_offload", {"route": "local"}),
            ("offload", {"route": "auto", "upstream_url": url}),
        ):
            log, meta = run_once(
                base.model_copy(update={"governor": True, **update}),
                minutes=minutes,
                time_scale=time_scale,
                model_dir=model_dir,
                arrival_every_s=arrival_every_s,
                sample_every_s=sample_wall_s,
            )
            meta.pop("audit")
            runs[name] = summarize(
                log,
                meta,
                time_scale=time_scale,
                minutes=minutes,
                sample_every_sim_s=sample_wall_s * time_scale,
            )
    off, no = runs["offload"], runs["no_offload"]
    ratio = off["ttft_ms_p95"] / no["ttft_ms_p95"] if off["ttft_ms_p95"] and no["ttft_ms_p95"] else None
    hotter = [k for k in ("peak_temperature_c", "mean_temperature_c") if (off[k] or 0) > (no[k] or 0)]
    report = {
        "benchmark": "sustained-offload",
        "profile": profile,
        "minutes": minutes,
        "time_scale": time_scale,
        "model": base.model,
        "upstream": where,
        "max_tokens_per_request": MAX_TOKENS,
        "arrivals": f"one request every {arrival_every_s:g} simulated seconds (open loop)",
        "governor": "pace control" if base.pace_control else "level machine (SIMMER_PACE_CONTROL=false)",
        "route_min_local_tok_s": base.route_min_local_tok_s,
        "route_max_local_wait_s": base.route_max_local_wait_s,
        "device_sampled_every_wall_s": sample_wall_s,
        "targets": {
            "p95_ttft_offload_over_no_offload": round(ratio, 3) if ratio else None,
            "p95_ttft_ok (<= 0.5)": bool(ratio is not None and ratio <= 0.5),
            "offload_zero_failed": off["failed_requests"] == 0,
            "offload_temperature_no_higher (peak and mean)": not hotter,
        },
        "summary": {
            name: {
                k: run[k]
                for k in (
                    "requests",
                    "failed_requests",
                    "served_upstream_share",
                    "routes",
                    "ttft_ms_p95",
                    "ttft_ms_median",
                    "peak_temperature_c",
                    "mean_temperature_c",
                    "end_temperature_c",
                    "seconds_above_throttle",
                    "device_kills",
                    "tok_s_mean",
                )
            }
            for name, run in runs.items()
        },
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in runs.items()},
        "series": {k: v["series"] for k, v in runs.items()},
    }
    if plot:
        plot_runs(runs, plot, profile=profile, time_scale=time_scale, title="offload vs no offload")
        report["plot"] = plot
    return report
