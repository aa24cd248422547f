"""One run: one server from cold, requests closed or open loop, the device sampled while they run."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sustained.client import PROMPTS, RunLog, stream_request
from bench.sustained.measure import summarize
from bench.sustained.process import server_cpu_s, server_process
from server.settings import Settings


def bench_settings(
    settings: Settings, profile: str, time_scale: float, log_level: str = "warning"
) -> Settings:
    """The server's settings in every run: the simulated device, no key, and the model kept loaded between
    requests (keep_alive < 0) as an app serving all the time keeps it; with keep_alive 0 every reply
    would unload it and the next one load it again."""
    return settings.model_copy(
        update={
            "thermal_source": f"sim:{profile}",
            "sim_time_scale": time_scale,
            "keep_alive_s": -1.0,
            "log_level": log_level,
            "api_key": None,
        }
    )


def run_each(
    base: Settings,
    configs: list[tuple[str, dict[str, Any]]],
    *,
    minutes: float,
    time_scale: float,
    model_dir: Path | None,
    endpoint: str = "chat",
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each configuration (settings over `base`; requests name its "model" when it has one) on its own cold
    device, one after the other: their summaries by name, and the children's socket audit lines."""
    runs: dict[str, dict[str, Any]] = {}
    audits: list[str] = []
    for name, update in configs:
        log, meta = run_once(
            base.model_copy(update=update),
            minutes=minutes,
            time_scale=time_scale,
            model_dir=model_dir,
            endpoint=endpoint,
            model=update.get("model"),
        )
        audits += meta.pop("audit")
        runs[name] = summarize(log, meta, time_scale=time_scale, minutes=minutes)
    return runs, audits


def run_once(
    settings: Settings,
    *,
    minutes: float,
    time_scale: float,
    model_dir: Path | None,
    arrival_every_s: float | None = None,
    sample_every_s: float | None = None,
    endpoint: str = "chat",
    model: str | None = None,
) -> tuple[RunLog, dict[str, Any]]:
    """One server, one run (requests to `endpoint`, naming `model` when given). Closed loop (the next
    request when the last one ended), or with `arrival_every_s` open loop: a new request every that many
    simulated seconds, whatever is running, as an app whose users do not wait for each other would send
    them. The device is sampled (GET /v1/thermal) once per simulated second, or every `sample_every_s` wall
    seconds."""
    log = RunLog()
    wall_s = minutes * 60.0 / time_scale
    with server_process(settings, model_dir=model_dir) as srv:
        log.rss_ready = srv.rss
        client = httpx.Client(base_url=srv.url, timeout=settings.pause_timeout_s + 60)
        stop = threading.Event()
        t0 = time.monotonic()
        end = t0 + wall_s

        def sample() -> None:
            period = sample_every_s or 1.0 / time_scale  # default: one sample per simulated second
            next_at = t0
            with httpx.Client(base_url=srv.url, timeout=10) as c:
                while not stop.is_set():
                    log.cpu.append((round((time.monotonic() - t0) * time_scale, 2), server_cpu_s(srv)))
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        th = c.get("/v1/thermal").json()
                        log.samples.append(
                            {
                                "t": round((time.monotonic() - t0) * time_scale, 2),
                                "temperature": th["temperature"]["celsius"],
                                "throttle_c": th["temperature"]["throttle_c"],
                                "critical_c": th["temperature"]["critical_c"],
                                "level": th["level"],
                                "variant": th["variant"],
                                "model": th.get("model"),
                                "threads": th["threads"],
                                "limit_threads": th["limits"]["threads"],
                                "paused": th["limits"]["pause_running"],
                                "device_killed": th["device_killed"],
                                "cpu_budget_cores": th["limits"].get("cpu_budget_cores"),
                                "pace_tok_s": th["limits"].get("tokens_per_second"),
                            }
                        )
                    next_at += period
                    stop.wait(max(0.0, next_at - time.monotonic()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if arrival_every_s is not None:
            _open_loop(srv.url, log, end, arrival_every_s / time_scale, settings.pause_timeout_s + 60)
        i = 0
        while arrival_every_s is None and time.monotonic() < end:
            rec = stream_request(client, PROMPTS[i % len(PROMPTS)], log, end, endpoint=endpoint, model=model)
            log.requests.append(rec)
            i += 1
            log.rss_after[i] = srv.rss
            if not rec.ok:
                time.sleep(0.1)  # an overheated device refuses at once: do not spin on it
        stop.set()
        sampler.join(5)
        log.cpu.append((round((time.monotonic() - t0) * time_scale, 2), server_cpu_s(srv)))
        client.close()
        metrics = ""
        with contextlib.suppress(httpx.HTTPError):
            metrics = httpx.get(srv.url + "/metrics", timeout=5).text
        kills = _metric(metrics, "simmer_device_kills_total")
        audit = srv.audit()
        meta = {
            "cold_start_s": round(srv.cold_start_s, 2),
            "kills": kills,
            "audit": audit,
            "t0": t0,
            "moves": moves_from_log(srv.log_lines()),
        }
    return log, meta


def _open_loop(url: str, log: RunLog, end: float, every_wall_s: float, timeout_s: float) -> None:
    """Start a request every `every_wall_s` until `end`, each on its own thread and connection; then wait
    for the ones still running (a request queued behind a pause has its TTFT yet to come)."""
    threads: list[threading.Thread] = []

    def one(prompt: str) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            log.requests.append(stream_request(client, prompt, log, end))

    next_at = time.monotonic()
    i = 0
    while next_at < end:
        t = threading.Thread(target=one, args=(PROMPTS[i % len(PROMPTS)],), daemon=True)
        t.start()
        threads.append(t)
        i += 1
        next_at += every_wall_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    for t in threads:
        t.join(timeout_s)


def moves_from_log(lines: list[str]) -> dict[str, Any]:
    """What the server logged (at info) about the ladder: the governor's rung moves (`rung a -> b: why`),
    replies moved to another model mid-way, and models unloaded (with why)."""
    rungs = [line.split("rung ", 1)[1] for line in lines if "simmer.governor: rung " in line]
    switches = [line for line in lines if ": the governor moves the reply to " in line]
    unloads = [line.split("unloaded ", 1)[1] for line in lines if "simmer.pool: unloaded " in line]
    return {
        "rung_moves": len(rungs),
        "rung_log": rungs[:40],
        "replies_moved": len(switches),
        "unloads": unloads[:40],
    }


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
