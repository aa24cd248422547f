"""Smoke-test a running simmer container from the host (used by docker/test.sh).

Streams one chat completion through the real `openai` SDK, then checks that the server reports the
container's limits, not the host's (the cgroup memory limit in GET /v1/thermal, the engine's thread count),
and that serving on 0.0.0.0 kept the protections: no key -> refused, a foreign Host header -> refused.

    python docker/smoke_client.py --base-url http://127.0.0.1:PORT --api-key KEY \
        --expect-memory-bytes 1073741824 --expect-threads 1

Prints one JSON summary line; exits 1 with every failed check's reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from openai import OpenAI

Path = tuple[str, ...]


def walk(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of a JSON document with its key path (list indices as strings)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from walk(value, (*path, str(key)))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from walk(value, (*path, str(i)))
    else:
        yield path, obj


def get_json(base_url: str, route: str, api_key: str) -> Any:
    req = urllib.request.Request(base_url + route, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def status_of(base_url: str, route: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(base_url + route, headers=headers), timeout=30
        ) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def protection_failures(base_url: str, api_key: str) -> list[str]:
    """Serving on 0.0.0.0 in the container must keep the API key and the Host check meaningful."""
    failures = []
    no_key = status_of(base_url, "/v1/models", {})
    if no_key not in (401, 403):
        failures.append(f"GET /v1/models without a key answered {no_key}, expected 401/403")
    # A DNS-rebinding page reaches us under its own name: the Host check must refuse it even with the key.
    rebound = status_of(
        base_url, "/v1/models", {"Authorization": f"Bearer {api_key}", "Host": "evil.example"}
    )
    if rebound not in (400, 403, 421):
        failures.append(f"GET /v1/models with Host: evil.example answered {rebound}, expected 400/403/421")
    return failures


def memory_limits(thermal: Any) -> dict[str, Any]:
    """Numeric fields under a `memory` object whose name says limit (limit, limit_bytes, limit_mb...)."""
    return {
        ".".join(p): v
        for p, v in walk(thermal)
        if "memory" in ".".join(p[:-1]).lower()
        and "limit" in p[-1].lower()
        and isinstance(v, int | float)
        and not isinstance(v, bool)
    }


def limit_matches(key: str, value: float, expected_bytes: int) -> bool:
    # The unit is in the field name when it is not bytes.
    scale = {"_mb": 2**20, "_mib": 2**20, "_gb": 2**30, "_gib": 2**30, "_kb": 2**10, "_kib": 2**10}
    for suffix, factor in scale.items():
        if key.lower().endswith(suffix):
            return abs(value * factor - expected_bytes) < factor
    return int(value) == expected_bytes


def thread_counts(doc: Any) -> dict[str, int]:
    return {
        ".".join(p): v
        for p, v in walk(doc)
        if p and "thread" in p[-1].lower() and isinstance(v, int) and not isinstance(v, bool)
    }


def stream_chat(base_url: str, api_key: str) -> dict[str, Any]:
    client = OpenAI(base_url=base_url + "/v1", api_key=api_key, timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    start = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    chunks = 0
    finish = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name one colour of the sky."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        chunks += 1
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.content or ""
        if delta and first is None:
            first = time.monotonic() - start
        parts.append(delta)
        finish = chunk.choices[0].finish_reason or finish
    text = "".join(parts)
    if not text.strip():
        raise AssertionError(f"the stream carried no text ({chunks} chunks)")
    return {"model": model, "chunks": chunks, "text": text, "finish_reason": finish, "ttft_s": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--expect-memory-bytes", type=int, required=True)
    ap.add_argument("--expect-threads", type=int, required=True)
    args = ap.parse_args(argv)
    base = args.base_url.rstrip("/")

    failures: list[str] = []
    summary: dict[str, Any] = {}
    try:
        summary["chat"] = stream_chat(base, args.api_key)
    except Exception as err:  # any SDK or content error: report it with the other checks
        failures.append(f"streamed chat completion: {type(err).__name__}: {err}")

    docs: dict[str, Any] = {}
    for route in ("/health", "/v1/thermal"):
        try:
            docs[route] = get_json(base, route, args.api_key)
        except (urllib.error.URLError, ValueError) as err:
            failures.append(f"GET {route}: {err}")
            docs[route] = {}

    limits = memory_limits(docs["/v1/thermal"])
    summary["memory_limits"] = limits
    if not any(limit_matches(k, v, args.expect_memory_bytes) for k, v in limits.items()):
        failures.append(f"/v1/thermal reports no memory limit of {args.expect_memory_bytes} bytes: {limits}")

    # The engine's own count (in /health) wins; else the governor's current limits in /v1/thermal.
    threads = thread_counts(docs["/health"]) or thread_counts(docs["/v1/thermal"])
    summary["threads"] = threads
    if not threads:
        failures.append("neither /health nor /v1/thermal reports a thread count")
    elif any(v != args.expect_threads for v in threads.values()):
        failures.append(f"expected {args.expect_threads} thread(s) everywhere, got {threads}")

    failures += protection_failures(base, args.api_key)
    print(json.dumps(summary))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
