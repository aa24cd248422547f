"""Routing on /metrics: configured, breaker state, requests by side and reason, upstream failures by kind.
Read from the router at scrape time (names and counts only)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.routing.router import Router

BREAKER_STATES = ("closed", "open", "half_open")


class RoutingCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        r = self.router
        yield GaugeMetricFamily(
            "simmer_upstream_configured", "1 when an upstream is configured", 1.0 if r.upstream else 0.0
        )
        policy = GaugeMetricFamily("simmer_route_policy", "1 for SIMMER_ROUTE", labels=["policy"])
        policy.add_metric([r.policy], 1.0)
        yield policy
        view = r.breaker.view()
        state = GaugeMetricFamily(
            "simmer_upstream_breaker_state", "1 for the upstream breaker's state", labels=["state"]
        )
        for name in BREAKER_STATES:
            state.add_metric([name], 1.0 if name == view.state else 0.0)
        yield state
        yield CounterMetricFamily(
            "simmer_upstream_breaker_opened", "Times the upstream breaker opened", view.opened
        )
        routed = CounterMetricFamily(
            "simmer_routed_requests",
            "Requests started on each side, by reason (a fallback counts on both sides)",
            labels=["route", "reason"],
        )
        for (side, reason), n in sorted(r.requests.items()):
            routed.add_metric([side, reason], n)
        yield routed
        failures = CounterMetricFamily(
            "simmer_upstream_failures", "Failed upstream attempts by kind", labels=["kind"]
        )
        for kind, n in sorted(r.failures.items()):
            failures.add_metric([kind], n)
        yield failures
