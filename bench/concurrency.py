"""`simmer bench concurrency`: N clients at once, each sending R streamed chat completions one after another,
over HTTP, against simmer with SIMMER_MAX_BATCH=N (replies decoded together where rows allow, in turns
elsewhere), with `--fast` also SIMMER_BATCH=fast (batched on every CPU), simmer with SIMMER_MAX_BATCH=1
(one reply at a time, as before batches) and, when given, llama.cpp's own `llama-server --parallel N`
(continuous batching) on the same GGUF, or llama-cpp-python's server (one reply at a time), or any
OpenAI-compatible peer URL. The systems take turns, round
after round (interleaved, the order rotated each round), each on its own server process started once.

Every request asks for exactly `max_tokens` tokens (`ignore_eos`), greedy; tokens are counted from the final
usage chunk. Per round and system: aggregate tokens/s (all completion tokens over the round's wall time,
first request sent to last token received), TTFT p50/p95 over the requests, and the inter-token latency
each client saw (the gaps between its tokens' arrivals, a chunk of k tokens counting k gaps of a k-th of
its wait; simmer's SSE coalescing is off here, SIMMER_STREAM_INTERVAL_MS=0, as llama-server sends each
token): p50 per client, then the median and the worst client. The report gives per system the median over
rounds, and the ratios of simmer's figures to the peer's and to simmer's own one-at-a-time server; and
`meter`, what each simmer server's cost meter measured at the end (its /metrics): CPU seconds per token and
tokens per second of a pass, per batch size (`rows`), which is what the governor's pace buys.
Numbers from a shared machine mean something only as ratios within one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.sustained.process import free_port, server_process, stop, wait_until_ready
from server.settings import Settings

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot learning to cook.",
    "What are three tips for staying focused while studying?",
    "Describe a walk through a forest in autumn.",
    "List five uses of a paperclip and explain each.",
    "Tell me about the history of bread.",
    "How does a bicycle stay upright?",
    "Write a poem about the sea at night.",
]


@dataclass
class Request:
    """One streamed reply: when it was sent, when each chunk with text arrived and how many tokens it had."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the chunk)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None

    def gaps(self) -> list[float]:
        """The wait before each token after the first: a chunk of k tokens counts k gaps of a k-th."""
        out: list[float] = []
        for (t0, _), (t1, k) in zip(self.arrivals, self.arrivals[1:], strict=False):
            out += [(t1 - t0) / max(k, 1)] * max(k, 1)
        return out


def stream_once(client: httpx.Client, model: str | None, prompt: str, max_tokens: int) -> Request:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    req = Request(time.perf_counter())
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                req.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return req
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    req.error = str(chunk["error"])[:300]
                    return req
                if chunk.get("usage"):
                    req.tokens = int(chunk["usage"]["completion_tokens"])
                pieces = [c.get("delta", {}).get("content") for c in chunk.get("choices") or []]
                if any(pieces):
                    # one token a chunk unless the server coalesced several (logprobs are not asked for,
                    # so a chunk's token count is unknown: its share is fixed below from the usage)
                    req.arrivals.append((time.perf_counter(), 1))
    except httpx.HTTPError as e:
        req.error = f"{type(e).__name__}: {e}"
    if not req.tokens:  # a peer without a usage chunk: a token a chunk
        req.tokens = len(req.arrivals)
    if req.arrivals and req.tokens > len(req.arrivals):
        # chunks carried several tokens (coalescing): spread the extra evenly over the chunks after the first
        extra, n = req.tokens - len(req.arrivals), len(req.arrivals) - 1
        req.arrivals = [req.arrivals[0]] + [
            (t, 1 + extra // n + (1 if i < extra % n else 0)) for i, (t, _) in enumerate(req.arrivals[1:])
        ]
    return req


def run_round(url: str, model: str | None, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads, each sending `requests` replies one after another; the round's figures."""
    per_client: list[list[Request]] = [[] for _ in range(clients)]

    def client_loop(c: int) -> None:
        # A connection per request, for every server alike: llama-server at times drops a connection kept
        # alive after a streamed reply, and the next request on it failed before any byte ("Server
        # disconnected"), which counted its reply as lost.
        for r in range(requests):
            prompt = PROMPTS[(c * requests + r) % len(PROMPTS)]
            with httpx.Client(base_url=url, timeout=600) as http:
                per_client[c].append(stream_once(http, model, prompt, max_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for rs in per_client for r in rs]
    errors = [r.error for r in done if r.error]
    ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)
    client_itl = [statistics.median(g) for rs in per_client if (g := [x for r in rs for x in r.gaps()])]
    tokens = sum(r.tokens for r in done)
    return {
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "aggregate_tok_s": round(tokens / wall, 2),
        "ttft_p50_s": round(_quantile(ttfts, 0.5), 3) if ttfts else None,
        "ttft_p95_s": round(_quantile(ttfts, 0.95), 3) if ttfts else None,
        "itl_p50_ms_per_client": [round(x * 1000, 2) for x in client_itl],
        "itl_p50_ms": round(statistics.median(client_itl) * 1000, 2) if client_itl else None,
        "itl_p50_ms_worst_client": round(max(client_itl) * 1000, 2) if client_itl else None,
        "errors": errors[:5],
        "requests": len(done),
    }


def run_long_short(
    url: str, model: str | None, *, long_clients: int, long_tokens: int, short_tokens: int, lead_s: float
) -> dict[str, Any]:
    """`long_clients` clients each stream one `long_tokens` reply; `lead_s` after they start, one more
    client asks for a short reply: how long its first token waits behind the others (and its whole reply)."""
    got: dict[str, Request] = {}

    def one(key: str, tokens: int, prompt: str) -> None:
        with httpx.Client(base_url=url, timeout=1800) as http:
            got[key] = stream_once(http, model, prompt, tokens)

    longs = [
        threading.Thread(target=one, args=(f"long{c}", long_tokens, PROMPTS[c % len(PROMPTS)]))
        for c in range(long_clients)
    ]
    t0 = time.perf_counter()
    for t in longs:
        t.start()
    time.sleep(lead_s)
    one("short", short_tokens, "Say hello.")
    short_done = time.perf_counter()
    for t in longs:
        t.join()
    short = got["short"]
    errors = [r.error for r in got.values() if r.error]
    return {
        "short_ttft_s": round(short.ttft_s, 3) if short.ttft_s is not None else None,
        "short_total_s": round(short_done - short.sent, 3),
        "long_tokens": sum(got[k].tokens for k in got if k != "short"),
        "wall_s": round(time.perf_counter() - t0, 3),
        "errors": errors[:5],
    }


def meter_costs(metrics: str) -> list[dict[str, Any]]:
    """The cost meter's table from a /metrics text (server/http/metrics.py): one entry per configuration
    and batch size, fewest rows first."""
    rows: dict[tuple, dict[str, Any]] = {}
    names = {
        "simmer_cost_cpu_seconds_per_token": "cpu_s_per_token",
        "simmer_cost_tokens_per_second": "tok_s",
    }
    for line in metrics.splitlines():
        name, _, rest = line.partition("{")
        if name not in names or "}" not in rest:
            continue
        labels_text, _, value = rest.rpartition("}")
        labels = dict(
            (k, v.strip('"'))
            for k, v in (part.split("=", 1) for part in labels_text.split(",") if "=" in part)
        )
        key = tuple(sorted(labels.items()))
        entry = rows.setdefault(key, {**labels, "rows": int(labels.get("rows", "1"))})
        entry[names[name]] = round(float(value), 6)
    out = list(rows.values())
    for e in out:
        cpu = e.get("cpu_s_per_token")
        e["tokens_per_cpu_s"] = round(1 / cpu, 1) if cpu else None
    return sorted(
        out, key=lambda e: (e.get("model", ""), e.get("variant", ""), e.get("threads", ""), e["rows"])
    )


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank quantile (the value below which a q share of them lie)."""
    k = max(0, min(len(sorted_xs) - 1, round(q * len(sorted_xs) + 0.5) - 1))
    return sorted_xs[k]


def llama_server_cmd(binary: str, gguf: Path, port: int, *, parallel: int, context: int, threads: int):
    """llama.cpp's own server: `parallel` slots of `context` tokens each (its -c is their total), continuous
    batching, `threads` for decode and for prompts."""
    return [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "-c",
        str(context * parallel),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--cont-batching",
        "--no-webui",
    ]


def llama_cpp_python_cmd(gguf: Path, port: int, *, context: int, threads: int) -> list[str]:
    """llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`): one llama.cpp context, one
    reply at a time (requests wait their turn), `context` tokens."""
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(context),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        # by default a new request interrupts the stream running (its client sees a cut reply): queue it
        "--interrupt_requests",
        "False",
    ]


@contextlib.contextmanager
def peer_process(cmd: list[str], port: int) -> Iterator[str]:
    """A peer server started by `cmd` on `port`, once it answers GET /v1/models."""
    tmp = Path(tempfile.mkdtemp(prefix="simmer-bench-peer-"))
    log = (tmp / "peer.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = lambda: httpx.get(url + "/v1/models", timeout=2).status_code == 200  # noqa: E731
        wait_until_ready(proc, ready, cmd[0], tmp / "peer.log", 120, poll_s=0.1)
        yield url
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_concurrency(
    settings: Settings,
    *,
    model_dir: Path | None = None,
    gguf: Path | None = None,
    llama_server_bin: str | None = None,
    llama_cpp_python: bool = False,
    peer_url: str | None = None,
    clients: int = 4,
    requests: int = 2,
    max_tokens: int = 128,
    rounds: int = 3,
    fast: bool = False,
    long_short: tuple[int, int] | None = None,
    max_batch: int | None = None,
) -> dict[str, Any]:
    threads = settings.threads or min(2, os.cpu_count() or 1)
    base = settings.model_copy(
        update={
            "thermal_source": "none",  # the transport and the scheduler, not the device
            "keep_alive_s": -1.0,
            "log_level": "warning",
            "api_key": None,
            "stream_interval_ms": 0,
            "threads": threads,
            "max_queue": max(16, clients * 2),
        }
    )
    with contextlib.ExitStack() as stack:
        systems: dict[str, tuple[str, None]] = {}
        rows = max_batch or clients  # --clients 1 --max-batch 4: a lone reply through the batch loop
        simmers = [("simmer_batched", rows, "exact"), ("simmer_one_at_a_time", 1, "exact")]
        if fast:
            simmers.append(("simmer_fast", rows, "fast"))
        for name, batch, mode in simmers:
            update = {"max_batch": batch, "batch": mode}
            srv = stack.enter_context(server_process(base.model_copy(update=update), model_dir=model_dir))
            systems[name] = (srv.url, None)
        with httpx.Client(base_url=systems["simmer_batched"][0], timeout=30) as c:
            thermal = c.get("/v1/thermal").json()
            served_model = c.get("/v1/models").json()["data"][0]["id"]
        ctx = settings.context_length
        if llama_server_bin and gguf:
            port = free_port()
            cmd = llama_server_cmd(
                llama_server_bin, gguf, port, parallel=clients, context=ctx, threads=threads
            )
            systems["llama_server"] = (stack.enter_context(peer_process(cmd, port)), None)
        elif llama_cpp_python and gguf:
            port = free_port()
            cmd = llama_cpp_python_cmd(gguf, port, context=ctx, threads=threads)
            systems["llama_cpp_python"] = (stack.enter_context(peer_process(cmd, port)), None)
        elif peer_url:
            systems["peer"] = (peer_url.removesuffix("/v1").rstrip("/"), None)
        names = list(systems)
        for name in names:  # warm: first-run allocations, every batch row's pages
            run_round(systems[name][0], served_model if name.startswith("simmer") else None, clients, 1, 16)
        results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                url, _ = systems[name]
                model = served_model if name.startswith("simmer") else None
                results[name].append(run_round(url, model, clients, requests, max_tokens))
        long_short_raw: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(rounds if long_short else 0):
            assert long_short is not None
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                model = served_model if name.startswith("simmer") else None
                long_short_raw[name].append(
                    run_long_short(
                        systems[name][0],
                        model,
                        long_clients=clients - 1,
                        long_tokens=long_short[0],
                        short_tokens=long_short[1],
                        lead_s=1.0,
                    )
                )
        meter = {}
        for name in [n for n, _, _ in simmers]:
            with httpx.Client(base_url=systems[name][0], timeout=30) as c:
                meter[name] = meter_costs(c.get("/metrics").text)

    def med(name: str, key: str) -> float | None:
        xs = [r[key] for r in results[name] if r[key] is not None]
        return round(statistics.median(xs), 3) if xs else None

    summary = {
        name: {
            key: med(name, key)
            for key in (
                "aggregate_tok_s",
                "ttft_p50_s",
                "ttft_p95_s",
                "itl_p50_ms",
                "itl_p50_ms_worst_client",
            )
        }
        for name in names
    }
    peer = next((n for n in ("llama_server", "llama_cpp_python", "peer") if n in summary), None)

    def median_of(rs: list[dict[str, Any]], key: str) -> float | None:
        xs = [r[key] for r in rs if r[key] is not None]
        return round(statistics.median(xs), 3) if xs else None

    long_short_summary = {
        name: {key: median_of(rs, key) for key in ("short_ttft_s", "short_total_s")}
        for name, rs in long_short_raw.items()
        if rs
    }

    def ratio(a: str, b: str | None, key: str) -> float | None:
        x, y = summary[a][key], summary[b][key] if b is not None else None
        return round(x / y, 3) if x and y else None

    return {
        "benchmark": "concurrency",
        "model": served_model,
        "variant": thermal.get("variant"),
        "threads": threads,
        "context_length": settings.context_length,
        "clients": clients,
        "max_batch": max_batch or clients,
        "requests_per_client": requests,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "peer": peer,
        "summary": summary,
        "ratios": {
            "batched_vs_one_at_a_time_tok_s": ratio(
                "simmer_batched", "simmer_one_at_a_time", "aggregate_tok_s"
            ),
            "batched_vs_peer_tok_s": ratio("simmer_batched", peer, "aggregate_tok_s"),
            "one_at_a_time_vs_peer_tok_s": ratio("simmer_one_at_a_time", peer, "aggregate_tok_s"),
            "batched_vs_peer_itl_p50": ratio("simmer_batched", peer, "itl_p50_ms"),
            "fast_vs_peer_tok_s": ratio("simmer_fast", peer, "aggregate_tok_s") if fast else None,
        },
        "long_short": {
            "long_tokens": long_short[0],
            "short_tokens": long_short[1],
            "long_clients": clients - 1,
            "lead_s": 1.0,
            "summary": long_short_summary,
            "raw": long_short_raw,
        }
        if long_short
        else None,
        "meter": meter,
        "rounds_raw": results,
    }
