"""Live-server tests' helpers: wait for a condition, read the worker's queue, a /metrics value, and the
request log lines."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def wait_until(predicate, timeout: float = 20.0) -> bool:  # generous: CI machines can be loaded
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        tick.wait(0.01)
    return False


def queue_depth(srv) -> int:
    return httpx.get(srv.url + "/health").json()["queue_depth"]


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def request_lines(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "simmer.request"]
