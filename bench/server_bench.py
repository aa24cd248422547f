"""`simmer bench server`: what HTTP streaming costs. Streamed tok/s and TTFT of a chat completion over HTTP
(httpx, the server as a child process as users run it) against the engine alone (DecoderEngine.generate in
this process), same model, variant and threads, in the same run, interleaved; medians.

Targets: HTTP streaming costs <= 5 % of tok/s and <= 10 ms of TTFT. TTFT is measured from sending the
request (HTTP) or calling generate (engine) to the first token's text; tok/s over the tokens after the
first, to the last one's arrival (the server's 50 ms coalescing delays that by up to one interval).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sustained.process import server_process
from models.types import GenerationParams, SamplingParams, TokenEvent
from server.settings import Settings

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot learning to cook.",
    "What are three tips for staying focused while studying?",
    "Describe a walk through a forest in autumn.",
]
MAX_TOKENS = 128


def _http_once(client: httpx.Client, prompt: str) -> tuple[float, float, int]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None
    return (first - t0) * 1000, (tokens - 1) / (last - first), tokens


def _engine_once(engine: Any, prompt: str) -> tuple[float, float, int]:
    params = GenerationParams(SamplingParams(temperature=0), max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    prompt_ids = engine.chat_prompt([{"role": "user", "content": prompt}])
    for event in engine.generate(prompt_ids, params):
        if isinstance(event, TokenEvent):
            tokens += 1
            if event.text:
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None
    return (first - t0) * 1000, (tokens - 1) / (last - first), tokens


def bench_server(settings: Settings, *, reps: int = 5, model_dir: Path | None = None) -> dict[str, Any]:
    from server.serving.engine_config import EngineConfig

    # No governing: this measures the transport, not the device (thermal "none" keeps the level nominal).
    # keep_alive -1: the model stays loaded (0 unloads it after every reply, and each TTFT was a load)
    server_settings = settings.model_copy(
        update={"thermal_source": "none", "keep_alive_s": -1.0, "log_level": "warning", "api_key": None}
    )
    with (
        server_process(server_settings, model_dir=model_dir) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as c,
    ):
        _http_once(c, PROMPTS[0])  # loads the model: /v1/thermal shows what ran last
        thermal = c.get("/v1/thermal").json()
        variant, threads = thermal["variant"], thermal["threads"]
        # the engine alone, opened as the server opens it (the same EngineConfig), on what the server runs
        config = EngineConfig.from_settings(settings, threads=threads)
        if model_dir is not None:
            engine = config.open_dir(Path(model_dir), variant=variant)
        else:
            engine = config.open_installed(settings.model, variant=variant)
        # warm both (first-run allocations, the prompt's KV slots), then alternate which goes first
        _engine_once(engine, PROMPTS[0])
        http: list[tuple[float, float, int]] = []
        alone: list[tuple[float, float, int]] = []
        for i in range(reps):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                alone.append(_engine_once(engine, prompt))
                http.append(_http_once(c, prompt))
            else:
                http.append(_http_once(c, prompt))
                alone.append(_engine_once(engine, prompt))

    def med(rows: list[tuple[float, float, int]], k: int) -> float:
        return round(statistics.median(r[k] for r in rows), 2)

    h_ttft, e_ttft = med(http, 0), med(alone, 0)
    h_tps, e_tps = med(http, 1), med(alone, 1)
    cost = (e_tps - h_tps) / e_tps * 100 if e_tps else None
    return {
        "benchmark": "server",
        "model": settings.model,
        "variant": variant,
        "threads": threads,
        "reps": reps,
        "max_tokens": MAX_TOKENS,
        "stream_interval_ms": settings.stream_interval_ms,
        "http": {"ttft_ms_median": h_ttft, "tok_s_median": h_tps},
        "engine_alone": {"ttft_ms_median": e_ttft, "tok_s_median": e_tps},
        "http_cost": {
            "tok_s_percent": round(cost, 2) if cost is not None else None,
            "ttft_ms": round(h_ttft - e_ttft, 2),
            "tok_s_ok (<= 5 %)": cost is not None and cost <= 5.0,
            "ttft_ok (<= 10 ms)": h_ttft - e_ttft <= 10.0,
        },
        "raw": {
            "http": [[round(x, 2) for x in r[:2]] for r in http],
            "engine_alone": [[round(x, 2) for x in r[:2]] for r in alone],
        },
    }
