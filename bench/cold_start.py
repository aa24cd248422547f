"""`simmer bench cold-start`: what a user of a cold server waits for. A fresh `simmer serve` process serving
a big model with a small one below it on the ladder; the benchmark asks /health until it answers 200, then at
once streams one chat and times it: the first token (from the request, and from the process start), when the
reply moved to the big model, the whole reply, and which models produced it. Two ways a cold start can go,
interleaved round by round in the same run:

- `stand_in` (SIMMER_COLD_START=stand_in, the default): the small model loads first and starts the reply;
  the big one, built beside the worker, takes it over once loaded;
- `wait` (SIMMER_COLD_START=wait): the reply waits for the big model's load, as every reply did before
  stand-ins (then behind a 503 "loading" /health; here /health is 200 at once in both modes).

The server's own log says how long each load took (its "loaded ... in N s" lines), reported beside.

`--stall` measures the other side of a load: a server with the small model loaded streams a long reply to
one client; a second client then asks for the big model, whose sessions are built beside the worker. The
stream's longest wait between two tokens during that load is reported against its median gap (each token
sent as it comes: SIMMER_STREAM_INTERVAL_MS=0), with the big model's first token for the second client.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import threading
import time
from typing import Any

import httpx

from bench.sustained.process import server_process
from server.settings import Settings

LOADED = re.compile(r"loaded (\S+?)/(\S+) in ([0-9.]+) s")
QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def chat_body(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The benchmark's one question, streamed, greedy."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def stream_chat(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat sent now: when its first token came, when it switched model, when it ended."""
    body = chat_body(model, max_tokens, governor_events=True)
    sent = time.monotonic()
    first = switched = None
    models: list[str] = []
    tokens, event = 0, None
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                continue
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            if event == "governor":
                if data.get("switch") and switched is None:
                    switched = time.monotonic() - sent
            elif data.get("choices") and data["choices"][0]["delta"].get("content"):
                first = first if first is not None else time.monotonic() - sent
                tokens += 1
                if not models or models[-1] != data["model"]:
                    models.append(data["model"])
            event = None
    return {
        "first_token_s": None if first is None else round(first, 3),
        "switched_at_s": None if switched is None else round(switched, 3),
        "total_s": round(time.monotonic() - sent, 3),
        "chunks": tokens,
        "models": models,
    }


def token_times(url: str, model: str, max_tokens: int, out: list[float]) -> None:
    """Stream one reply of `max_tokens` (ignore_eos), appending when each token's chunk arrived."""
    body = chat_body(model, max_tokens, ignore_eos=True)
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                out.append(time.monotonic())


def run_stall(settings: Settings, model: str, stand_in: str, max_tokens: int) -> dict[str, Any]:
    """The small model streams; 1 s in, another client asks for the big model (its load beside the worker)."""
    update = {"model": stand_in, "ladder": None, "stream_interval_ms": 0, "max_batch": 1}
    with server_process(settings.model_copy(update=update)) as srv:
        times: list[float] = []
        streaming = threading.Thread(target=token_times, args=(srv.url, stand_in, max_tokens, times))
        streaming.start()
        time.sleep(1.0)
        asked = time.monotonic()
        big = stream_chat(srv.url, model, 16)
        streaming.join()
        loads = {m: float(s) for m, _, s in LOADED.findall("\n".join(srv.log_lines()))}
    gaps = [b - a for a, b in itertools.pairwise(times)]
    during = [b - a for a, b in itertools.pairwise(times) if b > asked and a < asked + loads.get(model, 0.0)]
    median = statistics.median(gaps) if gaps else None
    return {
        "stream_tokens": len(times),
        "median_gap_ms": None if median is None else round(median * 1000, 1),
        "max_gap_during_load_ms": round(max(during) * 1000, 1) if during else None,
        "max_gap_ms": round(max(gaps) * 1000, 1) if gaps else None,
        "max_over_median": round(max(during) / median, 2) if during and median else None,
        "big_first_token_s": big["first_token_s"],
        "loads_s": loads,
    }


def run_once(settings: Settings, mode: str, model: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.monotonic()
    with server_process(settings.model_copy(update={"cold_start": mode}), loaded=False) as srv:
        healthy = time.monotonic() - t0
        status = httpx.get(srv.url + "/health", timeout=5).json()["status"]
        reply = stream_chat(srv.url, model, max_tokens)
        reply["first_token_from_start_s"] = round(healthy + (reply["first_token_s"] or 0.0), 3)
        loads = {m: float(s) for m, _, s in LOADED.findall("\n".join(srv.log_lines()))}
    return {"mode": mode, "healthy_s": round(healthy, 3), "health_status": status, **reply, "loads_s": loads}


def bench_cold_start(
    settings: Settings,
    *,
    model: str,
    stand_in: str,
    rounds: int = 3,
    max_tokens: int = 128,
    stall: bool = False,
) -> dict[str, Any]:
    base = settings.model_copy(
        update={
            "model": model,
            "ladder": f"{model},{stand_in}",
            "thermal_source": "none",  # the load path, not the device
            "keep_alive_s": -1.0,
            "log_level": "info",  # the loads' own timings
            "api_key": None,
            "summary": False,
        }
    )
    modes = ["stand_in", "wait"]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(rounds):
        for mode in modes[i % 2 :] + modes[: i % 2]:
            runs[mode].append(run_once(base, mode, model, max_tokens))

    def med(mode: str, key: str) -> float | None:
        xs = [r[key] for r in runs[mode] if r[key] is not None]
        return round(statistics.median(xs), 3) if xs else None

    keys = ("healthy_s", "first_token_s", "first_token_from_start_s", "switched_at_s", "total_s")
    stalls = [run_stall(base, model, stand_in, 600) for _ in range(rounds if stall else 0)]
    return {
        "benchmark": "cold-start",
        "model": model,
        "stand_in": stand_in,
        "max_tokens": max_tokens,
        "threads": settings.threads,
        "rounds": rounds,
        "median": {m: {k: med(m, k) for k in keys} for m in modes},
        "runs": runs,
        "stall": stalls,
    }
