"""`simmer bench soak`: does the server's memory stay flat under a long, mixed, partly rude load?

The server runs as a child process (`simmer serve` as users run it, on the installed model or a converted
folder). Four client threads send chat completions back to back for `minutes`: half streamed, half not,
and 20 % of them cut early (a stream closed after its first chunks, a non-streamed request abandoned by a
short client timeout, so some are cut while still queued). Conversations vary in length, so the prefix
cache hits, misses and evicts. The server's RSS (and its threads and open files, the other things that
leak) is sampled every 10 s.

Warm-up: the first 2 minutes (20 % of a run shorter than 10 minutes): the allocator's arenas, the
onnxruntime arena, the prefix KV slots and Python's caches fill up first. Growth after warm-up compares
the median RSS of the samples in the last minute with the median of the samples in the minute after the
warm-up (medians: one sample can catch a transient buffer), and the least-squares slope after warm-up says
whether it still rises. Target: <= 2 % growth after warm-up, 0 errors. Cut requests are not errors; any
other non-200 answer or error event is.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.memory import smaps_rss
from bench.sustained.client import PROMPTS
from bench.sustained.process import server_process
from server.settings import Settings

CLIENTS = 4
CUT_FRACTION = 0.20
SAMPLE_S = 10.0
WARMUP_S = 120.0
TARGET_GROWTH_PERCENT = 2.0
MAX_TOKENS = (16, 96)  # per request, drawn uniformly
CUT_STREAM_AFTER_CHUNKS = 2
CUT_NON_STREAM_TIMEOUT_S = 0.4


@dataclass
class SoakLog:
    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """One to four turns from the prompt list: shared prefixes and new ones, short and long prompts."""
    turns = rng.randint(1, 4)
    messages: list[dict[str, str]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": rng.choice(PROMPTS)})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": rng.choice(PROMPTS)})
    return messages


def one_request(client: httpx.Client, rng: random.Random, log: SoakLog) -> None:
    stream = rng.random() < 0.5
    cut = rng.random() < CUT_FRACTION
    body = {
        "messages": conversation(rng),
        "max_tokens": rng.randint(*MAX_TOKENS),
        "temperature": 0.7,
        "seed": rng.randrange(1 << 31),
        "stream": stream,
        "truncate": True,  # as the UI's "drop oldest turns": a small-context model still answers
    }
    kind = "stream" if stream else "non_stream"
    try:
        if stream:
            _stream(client, body, cut, kind, log)
        elif cut:
            with contextlib.suppress(httpx.TimeoutException):
                client.post("/v1/chat/completions", json=body, timeout=CUT_NON_STREAM_TIMEOUT_S)
                log.count(f"{kind}_finished_before_cut")
                return
            log.count(f"{kind}_cut")
        else:
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code == 200:
                log.count(f"{kind}_completed")
            else:
                log.count(f"error_http_{r.status_code}", r.text[:300])
    except httpx.HTTPError as err:
        log.count("error_transport", f"{type(err).__name__}: {err}")


def _stream(client: httpx.Client, body: dict, cut: bool, kind: str, log: SoakLog) -> None:
    chunks = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            log.count(f"error_http_{r.status_code}", r.text[:300])
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                log.count(f"{kind}_completed" if not cut else f"{kind}_finished_before_cut")
                return
            if "error" in json.loads(data):
                log.count("error_event", data[:300])
                return
            chunks += 1
            if cut and chunks >= CUT_STREAM_AFTER_CHUNKS:
                log.count(f"{kind}_cut")
                return  # leaving the block closes the connection mid-stream
    log.count("error_no_done", "the stream ended without [DONE]")


def sample(proc: psutil.Process, t0: float) -> dict[str, float]:
    with proc.oneshot():
        mem = proc.memory_info()
        return {
            "t_s": round(time.monotonic() - t0, 1),
            "rss_mib": round(mem.rss / 2**20, 2),
            # of which pages of mapped files (weights read in place): clean, shared, not a leak's kind
            "rss_file_mib": round(getattr(mem, "shared", 0) / 2**20, 2),
            "threads": proc.num_threads(),
            "fds": proc.num_fds(),
        }


def smaps_summary(pid: int, top: int = 12) -> dict[str, float]:
    """Resident MiB by mapping (file name, [heap], [anon], ...): where the memory is (Linux; else empty)."""
    totals: Counter = Counter()
    for name, kib in smaps_rss(f"/proc/{pid}/smaps").items():
        totals[name.rsplit("/", 1)[-1]] += kib
    return {k: round(v / 1024, 2) for k, v in totals.most_common(top)}


def growth(samples: list[dict[str, float]], warmup_s: float) -> dict[str, Any]:
    """Growth after warm-up: median RSS of the last minute against the minute after warm-up, and the slope."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {"growth_after_warmup_percent": None, "note": "the run is too short to pass warm-up"}
    end_t = after[-1]["t_s"]
    first = [s["rss_mib"] for s in after if s["t_s"] < warmup_s + 60] or [after[0]["rss_mib"]]
    last = [s["rss_mib"] for s in after if s["t_s"] > end_t - 60] or [after[-1]["rss_mib"]]
    base, end = statistics.median(first), statistics.median(last)
    ts = [s["t_s"] / 60 for s in after]
    rss = [s["rss_mib"] for s in after]
    mean_t, mean_r = statistics.fmean(ts), statistics.fmean(rss)
    var = sum((t - mean_t) ** 2 for t in ts)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(ts, rss, strict=True)) / var if var else 0.0
    return {
        "rss_after_warmup_mib": round(base, 2),
        "rss_end_mib": round(end, 2),
        "growth_after_warmup_percent": round((end - base) / base * 100, 2),
        "slope_after_warmup_mib_per_min": round(slope, 3),
    }


def bench_soak(
    settings: Settings,
    *,
    minutes: float = 10.0,
    model_dir: Path | None = None,
    clients: int = CLIENTS,
    sample_s: float = SAMPLE_S,
    warmup_s: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    run_s = minutes * 60.0
    warmup = warmup_s if warmup_s is not None else min(WARMUP_S, 0.2 * run_s)
    # No governing (a hot machine must not pause the load), no unloading when idle, quiet logs.
    server_settings = settings.model_copy(
        update={"thermal_source": "none", "keep_alive_s": 0.0, "log_level": "warning", "api_key": None}
    )
    log = SoakLog()
    with server_process(server_settings, model_dir=model_dir) as srv:
        proc = psutil.Process(srv.proc.pid)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            health = c.get("/health").json()
        t0 = time.monotonic()
        end = t0 + run_s
        ready = sample(proc, t0)
        stop = threading.Event()

        def client_loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            # generous: a non-streamed request may wait behind three others on a slow device
            with httpx.Client(base_url=srv.url, timeout=600) as client:
                while time.monotonic() < end and not stop.is_set():
                    one_request(client, rng, log)

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        maps_at_warmup: dict[str, float] = {}
        try:
            next_at = t0 + sample_s
            while time.monotonic() < end:
                time.sleep(max(0.0, min(next_at, end) - time.monotonic()))
                if srv.proc.poll() is not None:
                    raise RuntimeError("the server exited during the soak")
                log.samples.append(sample(proc, t0))
                if not maps_at_warmup and time.monotonic() - t0 >= warmup:
                    maps_at_warmup = smaps_summary(proc.pid)
                next_at += sample_s
            maps_at_end = smaps_summary(proc.pid)
        finally:
            stop.set()
            for t in threads:
                t.join(620)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            metrics = c.get("/metrics").text
        final = sample(proc, t0)

    outcomes = dict(sorted(log.outcomes.items()))
    errors = sum(n for k, n in outcomes.items() if k.startswith("error"))
    result = growth(log.samples, warmup)
    grew = result.get("growth_after_warmup_percent")
    return {
        "benchmark": "soak",
        "model": health.get("model"),
        "variant": health.get("variant"),
        "minutes": minutes,
        "clients": clients,
        "cut_fraction": CUT_FRACTION,
        "warmup_s": warmup,
        "sample_s": sample_s,
        "requests": {"total": sum(outcomes.values()), "by_outcome": outcomes},
        "errors": errors,
        "error_examples": log.errors,
        **result,
        "target": {
            f"growth_ok (<= {TARGET_GROWTH_PERCENT:g} %)": grew is not None and grew <= TARGET_GROWTH_PERCENT,
            "errors_ok (0)": errors == 0,
        },
        "ready": ready,
        "final": final,
        # resident MiB per mapping after warm-up and at the end: where any growth went
        "mappings_after_warmup_mib": maps_at_warmup,
        "mappings_end_mib": maps_at_end,
        "server_completions": _completions(metrics),
        "samples": log.samples,
    }


def _completions(metrics_text: str) -> dict[str, float]:
    """simmer_completions_total by outcome, as the server counted them."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "simmer_completions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get("outcome", "")] = s.value
    return out
