"""Failure semantics against the real upstream process: down before the start, killed mid-stream, the client
hanging up, the breaker opening and closing (on a fake clock), and what never leaves or gets logged."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from models.runtime.engine import load_engine
from server.routing.breaker import Breaker
from tests.server.fakes import RecordingEngine
from tests.server.routing.conftest import MODEL, UPSTREAM_KEY, free_port, start_upstream
from tests.server.routing.helpers import CHAT, stream, text_of

LONG = {**CHAT, "max_tokens": 150, "ignore_eos": True}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def metric(srv, name: str, **labels: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") if labels else line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_upstream_when_down_before_start_then_served_locally(local) -> None:
    """Nothing listens at the upstream's address: the reply comes from the device, and says so."""
    srv = local(route="upstream", upstream_url=f"http://127.0.0.1:{free_port()}/v1")
    with srv.client() as c:
        expected = c.post("/v1/chat/completions", json={**CHAT, "route": "local"}).json()
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers["x-simmer-route"] == "local; reason=upstream_failed"
    assert r.json()["route"] == {"served": "local", "reason": "upstream_failed"}
    assert r.json()["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    r, chunks, done = stream(srv, "/v1/chat/completions", CHAT)
    assert done and r.headers["x-simmer-route"] == "local; reason=upstream_failed"
    assert text_of(chunks, "chat") == expected["choices"][0]["message"]["content"]
    assert chunks[-1]["route"] == {"served": "local", "reason": "upstream_failed"}
    assert metric(srv, "simmer_upstream_failures_total", kind="connect") == 2
    assert metric(srv, "simmer_routed_requests_total", route="local", reason="upstream_failed") == 2


def test_route_upstream_when_down_then_503_upstream_unavailable_never_local(local, tiny_model_dir) -> None:
    engine = RecordingEngine(load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256))
    srv = local(upstream_url=f"http://127.0.0.1:{free_port()}/v1", engine=engine)
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "route": "upstream"})
        s = c.post("/v1/chat/completions", json={**CHAT, "route": "upstream", "stream": True})
    for resp in (r, s):
        assert resp.status_code == 503
        err = resp.json()["error"]
        assert err["code"] == "upstream_unavailable" and "Connection refused" in err["message"]
        assert int(resp.headers["retry-after"]) >= 1
    assert engine.generations == []  # the client insisted on upstream: the device did not answer instead


def test_upstream_when_killed_mid_stream_then_error_event_and_done_no_switch(
    tiny_model_dir, tmp_path, live
) -> None:
    """SIGKILL the upstream after the first chunk: the text so far stays (no duplicate, no restart on the
    device), then an error event and [DONE]."""
    upstream = start_upstream(tiny_model_dir, tmp_path, pace=25)
    try:
        engine = RecordingEngine(load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256))
        srv = live(
            engine=engine,
            model=MODEL,
            route="auto",
            upstream_url=upstream.url + "/v1",
            upstream_api_key=UPSTREAM_KEY,
        )
        with srv.client() as c:
            reference = c.post("/v1/chat/completions", json={**LONG, "route": "local"}).json()
        full = reference["choices"][0]["message"]["content"]
        body = {**LONG, "route": "upstream", "stream": True}
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            text, error, done = "", None, False
            for line in lines:
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                got = text_of([chunk], "chat")
                if got and not text:
                    upstream.kill()  # mid-reply: at 25 tok/s the other 149 tokens are seconds away
                text += got
        assert done and error is not None
        assert error["code"] == "upstream_error" and "mid-reply" in error["message"]
        assert text and full.startswith(text) and len(text) < len(full)
        assert len(engine.generations) == 1  # the reference only: nothing restarted on the device
        assert metric(srv, "simmer_upstream_failures_total", kind="dropped") == 1
    finally:
        upstream.stop()


def test_client_disconnect_when_served_upstream_then_upstream_request_cancelled(
    local, tiny_model_dir, tmp_path
) -> None:
    slow = start_upstream(tiny_model_dir, tmp_path, pace=25)
    try:
        srv = local(upstream_url=slow.url + "/v1")
        body = {**LONG, "route": "upstream", "stream": True}
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: ") and text_of([json.loads(line[6:])], "chat"):
                    break  # one token in: hang up
        deadline = time.monotonic() + 10
        while slow.metric("simmer_completions_total", outcome="client_gone") < 1:
            assert time.monotonic() < deadline, "the upstream never saw its client leave"
            time.sleep(0.05)
        assert slow.metric("simmer_completions_total", outcome="length") == 0  # it did not run to the end
    finally:
        slow.stop()


def test_breaker_when_n_failures_then_open_and_after_cooldown_closed(local, proxy, upstream) -> None:
    """The upstream host accepts and drops every connection: after 2 failures (each served locally) the
    breaker opens and the next request does not even connect; after the cooldown (a fake clock) one probe
    goes, the upstream is back, the breaker closes."""
    clock = FakeClock()
    proxy.target_port = None  # drop every connection
    srv = local(route="upstream", breaker=Breaker(2, 30.0, clock=clock))
    ask = lambda c: c.post("/v1/chat/completions", json=CHAT)  # noqa: E731
    with srv.client() as c:
        for n in (1, 2):
            r = ask(c)
            assert r.json()["route"] == {"served": "local", "reason": "upstream_failed"}
            assert proxy.connections == n
        assert metric(srv, "simmer_upstream_breaker_state", state="open") == 1
        r = ask(c)
        assert r.json()["route"] == {"served": "local", "reason": "breaker_open"}
        assert proxy.connections == 2  # open: not even a connection
        clock.now += 29.0
        assert ask(c).json()["route"]["reason"] == "breaker_open" and proxy.connections == 2
        clock.now += 1.0
        assert metric(srv, "simmer_upstream_breaker_state", state="half_open") == 1
        proxy.target_port = upstream.port  # the upstream is back
        r = ask(c)
        assert r.json()["route"] == {"served": "upstream", "reason": "policy"}
        assert proxy.connections == 3
        assert metric(srv, "simmer_upstream_breaker_state", state="closed") == 1
        assert metric(srv, "simmer_upstream_breaker_opened_total") == 1


def test_policy_local_when_anything_asked_then_no_connection_to_upstream(local, proxy) -> None:
    srv = local(route="local")
    with srv.client() as c:
        assert c.post("/v1/chat/completions", json=CHAT).json()["route"] == {
            "served": "local",
            "reason": "policy",
        }
        assert c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "route": "auto"}
        ).json()["route"] == {"served": "local", "reason": "policy"}
        refused = c.post("/v1/chat/completions", json={**CHAT, "route": "upstream"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "upstream_not_allowed"
        refused = c.post("/v1/chat/completions", json=CHAT, headers={"X-Simmer-Route": "upstream"})
        assert refused.status_code == 403
        models = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        c.get("/metrics")
    assert proxy.connections == 0


def test_route_local_when_auto_server_then_no_connection_to_upstream(local, proxy) -> None:
    srv = local(route="auto")
    with srv.client() as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json={**CHAT, "route": "local"}).status_code == 200
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Simmer-Route": "local"})
        assert r.status_code == 200 and r.headers["x-simmer-route"] == "local; reason=request"
    assert proxy.connections == 0


def test_upstream_key_when_used_then_never_in_logs_responses_or_metrics(
    local, proxy, upstream, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    # a client library imported earlier in the session (litellm) quiets httpx's logger on its own
    caplog.set_level(logging.DEBUG, logger="httpx")
    srv = local(route="upstream")
    seen: list[str] = []
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["route"]["served"] == "upstream"  # the upstream demands the key: it was sent
        seen += [r.text, str(r.headers)]
        r, chunks, _ = stream(srv, "/v1/chat/completions", CHAT)
        seen += [json.dumps(chunks), str(r.headers)]
        seen.append(c.get("/metrics").text)
        seen.append(c.get("/v1/models").text)
    seen.append(repr(srv.settings))
    # a wrong key: the upstream says 401, the client learns that, not the key
    wrong = "sk-wrong-" + UPSTREAM_KEY[-8:] + "x"
    bad = local(route="upstream", upstream_api_key=wrong)
    with bad.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "route": "upstream"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert "HTTP 401" in r.json()["error"]["message"]
    seen += [r.text, str(r.headers)]
    logs = caplog.text + "".join(str(rec.__dict__) for rec in caplog.records)
    assert "HTTP Request: POST" in logs  # httpx logged the calls: the check below looked at them
    for text in [*seen, logs]:
        assert UPSTREAM_KEY not in text and wrong not in text
    assert UPSTREAM_KEY not in upstream.log_path.read_text()


def test_stream_when_served_upstream_then_recoalesced_at_local_interval(local) -> None:
    """The upstream streams 40 tokens over ~0.1 s in its own chunks; the device re-coalesces them at its own
    SIMMER_STREAM_INTERVAL_MS (here 30 s): the first token at once, everything else with the finish."""
    srv = local(stream_interval_ms=30_000)
    r, chunks, done = stream(
        srv, "/v1/chat/completions", {**CHAT, "max_tokens": 40, "ignore_eos": True, "route": "upstream"}
    )
    content = [c for c in chunks if text_of([c], "chat")]
    assert done and r.headers["x-simmer-route"].startswith("upstream")
    assert len(content) == 2 and chunks[-1]["usage"]["completion_tokens"] == 40


def test_models_when_upstream_only_ids_then_listed_remote_and_served_as_named(local, proxy) -> None:
    srv = local(upstream_models={"big-remote": MODEL})
    with srv.client() as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models[MODEL].get("remote", False) is False
        assert models["big-remote"]["remote"] is True and models["big-remote"]["owned_by"] == "upstream"
        r = c.post("/v1/chat/completions", json={**CHAT, "model": "big-remote"})
        assert r.json()["route"] == {"served": "upstream", "reason": "model"}
        assert r.json()["model"] == "big-remote"  # as the client asked, not the upstream's name
        forbidden = c.post("/v1/chat/completions", json={**CHAT, "model": "big-remote", "route": "local"})
        assert forbidden.status_code == 404 and forbidden.json()["error"]["code"] == "model_not_found"
        unknown = c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert unknown.status_code == 404
    assert proxy.connections == 1


@pytest.mark.parametrize("route", ["auto", "upstream"])
def test_offline_when_host_does_not_resolve_then_breaker_opens_at_once(local, route) -> None:
    """`.invalid` never resolves (RFC 6761): no route to the upstream is an "offline" failure, which opens
    the breaker on the first one, so the device stops trying at once."""
    srv = local(route=route, upstream_url="http://upstream.invalid/v1")
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"X-Simmer-Route": "upstream"})
        assert r.status_code == 503 and "resolve" in r.json()["error"]["message"]
        assert metric(srv, "simmer_upstream_breaker_state", state="open") == 1
        assert c.post("/v1/chat/completions", json=CHAT).json()["route"]["served"] == "local"


def test_thread_safety_when_concurrent_upstream_and_local_then_all_answered(local, proxy) -> None:
    srv = local()
    results: list[dict] = []

    def ask(route: str) -> None:
        with srv.client() as c:
            results.append(c.post("/v1/chat/completions", json={**CHAT, "route": route}).json())

    threads = [threading.Thread(target=ask, args=(r,)) for r in ["upstream", "local"] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r["route"]["served"] for r in results) == ["local"] * 4 + ["upstream"] * 4
    assert len({r["choices"][0]["message"]["content"] for r in results}) == 1
