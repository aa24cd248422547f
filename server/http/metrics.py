"""Prometheus metrics, one registry per app (so tests and several apps in one process do not collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, queue_depth: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "simmer_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.completions = Counter(
            "simmer_completions", "Completion requests by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("simmer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("simmer_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "simmer_ttft_seconds", "Time to first token (queue included)", buckets=_TTFT_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "simmer_inter_token_seconds", "Time between generated tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.busy = Counter("simmer_busy_seconds", "Seconds the worker spent on requests", registry=r)
        self.truncated = Counter(
            "simmer_truncated_replies", "Replies whose sliding window dropped part of the context", registry=r
        )
        self.summarized = Counter(
            "simmer_summarized_replies", "Replies whose dropped turns came as a summary note", registry=r
        )
        self.embedded_inputs = Counter(
            "simmer_embedding_inputs", "Inputs embedded (a vector each), by model", ["model"], registry=r
        )
        self.embedded_tokens = Counter(
            "simmer_embedding_tokens", "Tokens run through an embedding model", ["model"], registry=r
        )
        self.queue = Gauge("simmer_queue_depth", "Requests waiting for the worker", registry=r)
        if queue_depth is not None:
            self.queue.set_function(queue_depth)

    def count_embedded(self, model: str, inputs: int, tokens: int) -> None:
        self.embedded_inputs.labels(model=model).inc(inputs)
        self.embedded_tokens.labels(model=model).inc(tokens)

    # WorkerMetrics (called on the worker thread; prometheus-client is thread-safe)
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def add_busy(self, seconds: float) -> None:
        self.busy.inc(seconds)

    def count_window(self, truncated: bool, summarized: bool) -> None:
        """A finished reply's sliding window."""
        if truncated:
            self.truncated.inc()
        if summarized:
            self.summarized.inc()

    def watch_summaries(self, summarizer: Any) -> None:
        """Export the summarizer's counters at scrape time (a serving/summary.py Summarizer): numbers only."""
        self.registry.register(SummaryCollector(summarizer))

    def add_tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(completion)

    def watch_governor(self, gate: Any, variant: Callable[[], str | None]) -> None:
        """Export the governor's state at scrape time (a GovernorGate; `variant` names what runs now)."""
        self.registry.register(GovernorCollector(gate, variant))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_LEVELS = ("nominal", "fair", "serious", "critical")


class GovernorCollector:
    """Temperature, headroom, level, variant and pauses, read from the governor's snapshot on each scrape."""

    def __init__(self, gate: Any, variant: Callable[[], str | None]) -> None:
        self.gate = gate
        self.variant = variant

    def describe(self) -> list[Metric]:
        return []  # metrics come and go with the sensors; do not pre-register names

    def collect(self) -> Iterator[Metric]:
        snap = self.gate.snapshot()
        if snap.temperature is not None:
            temp = GaugeMetricFamily(
                "simmer_temperature_celsius", "Governing temperature", labels=["source", "sensor"]
            )
            temp.add_metric([snap.temperature_source, snap.temperature.sensor], snap.temperature.celsius)
            yield temp
        if snap.headroom is not None:
            yield GaugeMetricFamily(
                "simmer_thermal_headroom", "Thermal headroom (1.0 = throttling)", snap.headroom
            )
        if snap.forecast_headroom is not None:
            yield GaugeMetricFamily(
                "simmer_thermal_headroom_forecast", "Thermal headroom forecast", snap.forecast_headroom
            )
        yield GaugeMetricFamily(
            "simmer_governor_level",
            "Governor level: 0 nominal, 1 fair, 2 serious, 3 critical",
            _LEVELS.index(snap.level),
        )
        state = GaugeMetricFamily("simmer_governor_level_state", "1 for the current level", labels=["level"])
        for level in _LEVELS:
            state.add_metric([level], 1.0 if level == snap.level else 0.0)
        yield state
        variant = self.variant()
        if variant is not None:
            info = GaugeMetricFamily("simmer_variant", "1 for the variant that runs now", labels=["variant"])
            info.add_metric([variant], 1.0)
            yield info
        if snap.limits.threads is not None:
            yield GaugeMetricFamily(
                "simmer_governor_threads", "Threads the governor allows", snap.limits.threads
            )
        paused = snap.limits.pause_running or snap.limits.pause_new
        yield GaugeMetricFamily("simmer_governor_paused", "1 while work is paused", 1.0 if paused else 0.0)
        yield CounterMetricFamily(
            "simmer_governor_pauses", "Times the governor paused work", self.gate.pauses
        )
        yield CounterMetricFamily(
            "simmer_governor_paused_seconds",
            "Worker seconds spent waiting out pauses",
            self.gate.paused_seconds,
        )
        yield CounterMetricFamily(
            "simmer_device_throttled_seconds",
            "Worker seconds idled by the (simulated) device's own throttling",
            self.gate.throttled_seconds,
        )
        yield from _meter_metrics(getattr(self.gate, "meter", None))
        sim = self.gate.governor.thermal.simulator
        if sim is not None:
            yield CounterMetricFamily(
                "simmer_device_kills", "Times the simulated device killed the app", sim.kills
            )


def _meter_metrics(meter: Any) -> Iterator[Metric]:
    """What the gate's meter measured (server/serving/cost_meter.py), per configuration and batch size
    (`rows`: replies a pass decoded): CPU seconds per token and tokens per second, unpaced."""
    costs = meter.table() if meter is not None else []
    if not costs:
        return
    labels = ["model", "variant", "threads", "spinning", "rows"]
    cpu = GaugeMetricFamily(
        "simmer_cost_cpu_seconds_per_token", "Process CPU seconds per token, measured", labels=labels
    )
    speed = GaugeMetricFamily(
        "simmer_cost_tokens_per_second", "Tokens per wall second of the passes, unpaced", labels=labels
    )
    for c in costs:
        key = [c.model_id or "", c.variant, str(c.threads), str(bool(c.spinning)).lower(), str(c.rows)]
        cpu.add_metric(key, c.cpu_s_per_token)
        speed.add_metric(key, c.tok_s)
    yield cpu
    yield speed


class SummaryCollector:
    """The sliding window's summaries (serving/summary.py): pieces written, preempted by a request, failed;
    summaries stored and pieces of work pending. Never their text."""

    def __init__(self, summarizer: Any) -> None:
        self.summarizer = summarizer

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.summarizer
        yield CounterMetricFamily("simmer_summaries_written", "Summary pieces written", s.written)
        yield CounterMetricFamily(
            "simmer_summaries_preempted", "Summary pieces stopped by a request (resumed later)", s.preempted
        )
        yield CounterMetricFamily("simmer_summaries_failed", "Summary pieces dropped by an error", s.failed)
        yield GaugeMetricFamily("simmer_summaries_stored", "Summaries kept (LRU)", len(s.store))
        yield GaugeMetricFamily(
            "simmer_summaries_pending", "Summary work waiting for an idle moment", len(s._pending)
        )


_KNOWN_ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/lifecycle",
    "/v1/thermal",
    "/v1/thermal/events",
    "/health",
    "/metrics",
    "/",
}


class MetricsMiddleware:
    """Counts every HTTP response by route and status (unknown paths share one label). Outermost, so the
    Host, key and size refusals and the 500s from ErrorMiddleware are counted too."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _KNOWN_ROUTES else "other"
        counted = False

        async def send_counted(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)
