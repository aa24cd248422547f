"""`simmer bench sustained`: back-to-back chat requests through the HTTP API on a simulated device, once
governed and once ungoverned, each on the same device starting cold. Prints (and plots) both runs.

The server runs as a child process (`simmer serve` as a user starts it), so the simulated device is heated
by the server's CPU time alone, not by this client. Time axes are simulated seconds; tok/s is real tokens
per wall second (the engine does not run faster because the device's heat capacity is scaled).

How close to the device's limit: the thermal envelope's limit is the busy cores the simulated device
sustains at T_throttle (its steady state, leakage included: DeviceProfile.sustainable_cores) times the best
tokens per CPU-second of the server measured in the same benchmark (process CPU of the server, all threads);
the governor's efficiency is its tok/s over the last 5 minutes over that limit. Mid-reply pauses are what a
user sees: `event: governor` stream events that pause a reply after its first token.

Offline check: the child installs a Python audit hook (PEP 578) that records every socket bind, connect,
sendto and getaddrinfo with its address; the report lists any that is not loopback. This client checks its
own requests the same way.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import os
import socket
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
import psutil
from pydantic import SecretStr

from server.settings import Settings

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot learning to cook.",
    "What are three tips for staying focused while studying?",
    "Describe a walk through a forest in autumn.",
    "Why do cats like boxes?",
    "Give me a recipe idea for a quick dinner.",
    "What is the difference between weather and climate?",
    "Write a haiku about the sea, then explain it.",
]
MAX_TOKENS = 160
WARM_UP_S = 120  # simulated seconds from cold before "no mid-reply pause" is asked of the governor
SPARSE_SAMPLE_S = 0.5  # wall seconds between device samples in the offload runs
LEVEL_INDEX = {"nominal": 0, "fair": 1, "serious": 2, "critical": 3}
RSS_AFTER = (1, 10, 20)  # the server's RSS reported after this many requests (it is read after every one)
WARM_SPAN = 10  # requests over which memory growth once warm is measured
WARM_KEY = f"ladder_memory_growth_mb_once_warm ({WARM_SPAN} requests after every model in use served once)"


# -- the server as a child process ------------------------------------------------------------------------
def _child_main() -> None:
    """Entry point of the child: audit hook, then `simmer serve` with the governed engine factory."""
    audit_fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    model_dir = sys.argv[2] or None
    install_socket_audit(lambda line: os.write(audit_fd, (line + "\n").encode()))
    from server.launch import build_server, gate_for
    from server.logs import setup_logging
    from server.serving.served import serve_folders, serve_store

    settings = Settings()
    setup_logging(settings.log_level, json_lines=False)
    served = serve_folders(settings, [Path(model_dir)]) if model_dir else serve_store(settings)
    build_server(settings, served=served, governor=gate_for(settings, served)).run()


def install_socket_audit(record: Any) -> None:
    """Record socket activity: `bind|connect|sendto|getaddrinfo <host> <port>` lines (PEP 578 events)."""

    def hook(event: str, args: tuple) -> None:
        if event in ("socket.bind", "socket.connect", "socket.sendto"):
            address = args[1] if event != "socket.sendto" else args[-1]
            if isinstance(address, tuple) and address:
                record(f"{event.split('.')[1]} {address[0]} {address[1] if len(address) > 1 else ''}")
            else:
                record(f"{event.split('.')[1]} unix {address!r}")
        elif event == "socket.getaddrinfo":
            record(f"getaddrinfo {args[0]} {args[1]}")

    sys.addaudithook(hook)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "unix", "", "None"):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback or str(host) in ("0.0.0.0", "::")
    except ValueError:
        return False


def summarize_audit(lines: list[str]) -> dict[str, Any]:
    events = [line.split(" ", 2) for line in lines if line.strip()]
    outside = [" ".join(e) for e in events if len(e) > 1 and not is_loopback(e[1])]
    return {
        "socket_events": len(events),
        "kinds": sorted({e[0] for e in events}),
        "non_loopback": outside[:20],
        "offline_ok": not outside,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(settings: Settings) -> dict[str, str]:
    """Settings as SIMMER_* variables, so the child builds the same Settings object."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()  # the child needs the key itself (it is never printed)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | dict):
            text = json.dumps(value)
        else:
            text = str(value)
        env[f"SIMMER_{name.upper()}"] = text
    return env


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    audit_path: Path
    cold_start_s: float
    log_path: Path | None = None

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines() if self.log_path else []

    @property
    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def audit(self) -> list[str]:
        return self.audit_path.read_text().splitlines() if self.audit_path.exists() else []


@contextlib.contextmanager
def server_process(
    settings: Settings, *, model_dir: Path | None = None, ready_timeout_s: float = 120.0
) -> Iterator[ServerProcess]:
    """Start `simmer serve` (with a socket audit) on a free loopback port; wait until /health is ok."""
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    tmp = Path(tempfile.mkdtemp(prefix="simmer-bench-"))
    audit_path = tmp / "audit.log"
    env = {**os.environ, **settings_env(settings)}  # the child inherits PATH etc., plus our settings
    code = "from bench.sustained import _child_main; _child_main()"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(audit_path), str(model_dir or "")],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "server.log").open("w"),
    )
    url = f"http://127.0.0.1:{settings.port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {(tmp / 'server.log').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(url + "/health", timeout=2)
                if r.status_code == 200:
                    break
                if r.json().get("status") == "error":
                    raise RuntimeError(f"the model failed to load: {r.json().get('error')}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.05)
        yield ServerProcess(url, proc, audit_path, time.monotonic() - t0, tmp / "server.log")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- one run ---------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    start: float
    ttft_s: float | None
    tokens: int
    ok: bool
    error: str | None = None
    pauses: int = 0  # times the governor paused this reply after its first token (what the user sees)
    pause_times: list[float] = field(default_factory=list)  # monotonic time of each
    served: str | None = None  # "local" | "upstream" (the route object of the final chunk)
    reason: str | None = None  # why it was served there (thermal, offline_first, ...)
    models: dict[str, int] = field(default_factory=dict)  # tokens per model (usage.models; cut: chunks')
    token_times: list[float] = field(default_factory=list)  # when each of its tokens arrived (monotonic)


@dataclass
class RunLog:
    samples: list[dict[str, Any]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # every token sent, replies that failed too
    requests: list[RequestRecord] = field(default_factory=list)
    rss_ready: int = 0
    rss_after: dict[int, int] = field(default_factory=dict)  # requests done -> the server's RSS then
    chars_per_token: list[float] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (simulated s, server CPU s so far)


def request_body(prompt: str, seed: int, endpoint: str = "chat", model: str | None = None) -> dict[str, Any]:
    """One benchmark request: a chat turn, or (endpoint "completions", for base models without a chat
    template) the same question as plain text to continue."""
    body: dict[str, Any] = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
    }
    if endpoint == "completions":
        body["prompt"] = f"Question: {prompt}\nAnswer:"
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if model:
        body["model"] = model
    return body


ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def stream_request(
    client: httpx.Client,
    prompt: str,
    log: RunLog,
    end: float,
    *,
    endpoint: str = "chat",
    model: str | None = None,
) -> RequestRecord:
    body = request_body(prompt, len(log.requests), endpoint, model)
    start = time.monotonic()
    rec = RequestRecord(start, None, 0, False)
    arrivals: list[tuple[float, int]] = []  # (time, characters) of each content chunk
    usage_tokens: int | None = None
    chunk_model: str | None = None
    event = ""
    paused = False
    try:
        with client.stream("POST", ENDPOINTS[endpoint], json=body) as r:
            if r.status_code != 200:
                r.read()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            # "upstream; reason=thermal": known at the start; the final chunk's route object confirms it
            route_header = r.headers.get("x-simmer-route") or ""
            rec.served = route_header.split(";")[0].strip() or None
            rec.reason = route_header.partition("reason=")[2].strip() or None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                    continue
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if event == "governor":
                    event = ""
                    paused = _count_pause(rec, json.loads(data), paused)
                    continue
                if data == "[DONE]":
                    rec.ok = rec.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("code")
                    continue
                now = time.monotonic()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                    rec.models = dict(chunk["usage"].get("models") or {})
                if isinstance(chunk.get("route"), dict):
                    rec.served = chunk["route"].get("served")
                    rec.reason = chunk["route"].get("reason")
                for choice in chunk.get("choices", []):
                    text = _chunk_text(choice)
                    if text:
                        chunk_model = chunk.get("model") or chunk_model
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        arrivals.append((now, len(text)))
                if now > end:
                    rec.ok = rec.error is None  # the run is over: stop reading (not a failure)
                    break
    except httpx.HTTPError as err:
        rec.error = f"{type(err).__name__}: {err}"
    finally:
        rec.tokens = _spread_tokens(arrivals, usage_tokens, log, rec)
        if not rec.models and rec.tokens and chunk_model:  # cut before its usage: the model that ran last
            rec.models = {chunk_model: rec.tokens}
    return rec


def _chunk_text(choice: dict[str, Any]) -> str:
    """A chat chunk's delta content, or a completions chunk's text."""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _count_pause(rec: RequestRecord, state: dict[str, Any], was_paused: bool) -> bool:
    """A governor event during a reply: count a pause that starts after the first token."""
    paused = bool(state.get("limits", {}).get("pause_running"))
    if paused and not was_paused and rec.ttft_s is not None:
        rec.pauses += 1
        rec.pause_times.append(time.monotonic())
    return paused


def _spread_tokens(
    arrivals: list[tuple[float, int]], usage_tokens: int | None, log: RunLog, rec: RequestRecord | None = None
) -> int:
    """A chunk carries the tokens of one 50 ms coalescing window: give each chunk its share of the reply's
    tokens (from usage) by its share of the characters. A reply cut at the end of the run has no usage:
    use the characters-per-token of the replies before it. The times go to the run's log and to `rec`'s."""
    chars = sum(c for _, c in arrivals)
    if not chars:
        return 0
    if usage_tokens is not None:
        log.chars_per_token.append(chars / max(1, usage_tokens))
        total = usage_tokens
    else:
        ratio = statistics.median(log.chars_per_token) if log.chars_per_token else 4.0
        total = max(1, round(chars / ratio))
    seen = given = 0
    for t, c in arrivals:
        seen += c
        n = round(total * seen / chars) - given
        log.token_times.extend([t] * n)
        if rec is not None:
            rec.token_times.extend([t] * n)
        given += n
    return total


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


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (no interpolation: a value some request really had)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def server_cpu_s(srv: ServerProcess) -> float:
    """User + system CPU seconds of the server process so far (all its threads)."""
    try:
        t = psutil.Process(srv.proc.pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


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


# -- the benchmark --------------------------------------------------------------------------------------
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
    runs: dict[str, dict[str, Any]] = {}
    audits: list[str] = []
    for name, governed in _runs(levels):
        log, meta = run_once(
            base.model_copy(update=governed),
            minutes=minutes,
            time_scale=time_scale,
            model_dir=model_dir,
        )
        audits += meta.pop("audit")
        runs[name] = summarize(log, meta, time_scale=time_scale, minutes=minutes)
    g, u = runs["governed"], runs["ungoverned"]
    ratio = g["tok_s_last_5min"] / u["tok_s_last_5min"] if u["tok_s_last_5min"] else None
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
            "governed_over_ungoverned_tok_s_last_5min": round(ratio, 3) if ratio else None,
            "tok_s_ratio_ok (>= 1.2)": bool(ratio and ratio >= 1.2),
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
            "memory_growth_mb_after_10_requests (rss after 10 - after 1)": _growth(
                rss["after_10_requests"], rss["after_1_request"]
            ),
            "memory_growth_mb_ready_to_10_requests": _growth(rss["after_10_requests"], rss["ready"]),
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


LADDER_TARGETS = {"tok_s_ratio": 2.0, "peak_over_throttle_c": 1.0, "growth_mb": 5.0}


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
) -> dict[str, Any]:
    """The ladder benchmark: the ladder across models against variants alone and against no governor, in
    one run, each configuration on the same simulated device starting cold. Requests name the ladder's
    first model (a client asks for the best one; the governor places the reply on its rung)."""
    client_audit: list[str] = []
    install_socket_audit(client_audit.append)
    base = bench_settings(settings, profile, time_scale, log_level="info")  # info: the moves are logged
    load_start = os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    audits: list[str] = []
    for name, update in ladder_runs(ladder):
        log, meta = run_once(
            base.model_copy(update=update),
            minutes=minutes,
            time_scale=time_scale,
            model_dir=model_dir,
            endpoint=endpoint,
            model=update["model"],
        )
        audits += meta.pop("audit")
        runs[name] = summarize(log, meta, time_scale=time_scale, minutes=minutes)
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
        "memory_growth_mb_1_to_10_requests": _growth(rss["after_10_requests"], rss["after_1_request"]),
        "memory_growth_mb_10_to_20_requests": _growth(rss["after_20_requests"], rss["after_10_requests"]),
        "memory_once_warm": run.get("memory_once_warm"),
    }


def ladder_targets(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ladder benchmark's targets, on the ladder configuration (the ratio against the ungoverned one)."""
    lad, ung = runs["ladder"], runs["ungoverned"]
    ratio = lad["tok_s_last_5min"] / ung["tok_s_last_5min"] if ung["tok_s_last_5min"] else None
    peak, throttle = lad["peak_temperature_c"], lad["throttle_c"]
    cold = _growth(lad["rss_mb"]["after_10_requests"], lad["rss_mb"]["after_1_request"])
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
        "growth_mb": None if end == warm else _growth(_mb(rss_after[end]), _mb(rss_after[warm])),
        "rss_mb_window": [_mb(x) for x in window],
        "how": f"RSS after request warm_after_request + {span} (or the run's last) minus RSS after request "
        "warm_after_request: the first request by which every model that served in this run had served once",
    }


def _growth(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 1)


def _rise(run: dict[str, Any]) -> float | None:
    if run["peak_temperature_c"] is None or run["start_temperature_c"] is None:
        return None
    return round(run["peak_temperature_c"] - run["start_temperature_c"], 2)


def plot_runs(
    runs: dict[str, dict[str, Any]],
    path: str,
    *,
    profile: str,
    time_scale: float,
    title: str = "governed vs ungoverned",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    colors = {
        "governed": "tab:blue",
        "ungoverned": "tab:red",
        "levels": "tab:green",
        "offload": "tab:green",
        "no_offload": "tab:red",
    }
    for name, run in runs.items():
        s = run["series"]
        t = [p["t"] for p in s]
        temp = [p["temperature"] for p in s]
        axes[0].plot(t, temp, color=colors[name], label=name)
        window = 10
        raw = [p["tok_s"] for p in s]
        smooth = [
            sum(raw[max(0, i - window + 1) : i + 1]) / len(raw[max(0, i - window + 1) : i + 1])
            for i in range(len(raw))
        ]
        axes[1].plot(
            t, smooth, color=colors[name], label=f"{name} ({run['tok_s_last_5min']} tok/s last 5 min)"
        )
        axes[2].step(
            t,
            [LEVEL_INDEX.get(p["level"]) if p["level"] else None for p in s],
            color=colors[name],
            where="post",
            label=name,
        )
        axes[3].step(t, [p["threads"] for p in s], color=colors[name], where="post", label=f"{name} threads")
    first = next(iter(runs.values()))
    if first["throttle_c"]:
        axes[0].axhline(first["throttle_c"], color="orange", linestyle="--", label="T_throttle")
    if first["critical_c"]:
        axes[0].axhline(first["critical_c"], color="black", linestyle=":", label="T_critical")
    axes[0].set_ylabel("skin temperature (C)")
    axes[1].set_ylabel("tok/s (10 s mean)")
    axes[2].set_ylabel("level")
    axes[2].set_yticks(range(4), list(LEVEL_INDEX))
    axes[3].set_ylabel("threads")
    axes[3].set_xlabel(f"simulated seconds (time_scale {time_scale:g})")
    for ax in axes:
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"simmer sustained benchmark: sim:{profile}, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
