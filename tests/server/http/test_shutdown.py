"""SIGTERM to a real `simmer serve` process: every open stream, running or still queued (before its first
ping), ends with an OpenAI-shaped server_shutting_down event and [DONE]; the process exits 0 within 5 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx

from tests.server.processes import free_port, wait_ready

# `simmer serve` (server.launch.serve, what the CLI calls) with a scripted engine that never ends alone.
SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from server.launch import serve
    from server.settings import Settings
    from tests.server.fakes import ScriptedEngine
    settings = Settings(port=int(sys.argv[1]), home=sys.argv[2], model="scripted-test", log_json=True,
                        thermal_source="none", keepalive_ping_s=30)
    serve(settings, engine_factory=lambda: ScriptedEngine(token_delay_s=0.01, reply_tokens=100_000))
    """
)
BODY = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def read_stream(url: str, into: dict, key: str, first_line: threading.Event | None = None) -> None:
    """Record the status, content type and every SSE data field of one streamed request."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=15) as r:
            into[key] = {"status": r.status_code, "type": r.headers.get("content-type", ""), "data": []}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    into[key]["data"].append(line[6:])
                    if first_line is not None:
                        first_line.set()
    except httpx.HTTPError as err:
        into[key] = {"error": repr(err)}


def test_serve_when_sigterm_with_running_and_fresh_queued_streams_then_all_end_with_error_done_exit_0(
    tmp_path,
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(port), str(tmp_path)],
        cwd=os.getcwd(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    results: dict = {}
    threads: list[threading.Thread] = []
    try:
        wait_ready(url, proc)
        running = threading.Event()
        threads.append(threading.Thread(target=read_stream, args=(url, results, "running", running)))
        threads[0].start()
        assert running.wait(10)
        for i in range(3):
            threads.append(threading.Thread(target=read_stream, args=(url, results, f"queued{i}")))
            threads[-1].start()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").json().get("queue_depth") != 3:
            assert time.monotonic() < deadline, "the three streams did not queue"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        code = proc.wait(timeout=10)
        took = time.monotonic() - sent_at
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    assert code == 0, stderr[-3000:]
    assert took < 5
    assert set(results) == {"running", "queued0", "queued1", "queued2"}
    for key, result in results.items():
        assert result.get("status") == 200 and result["type"].startswith("text/event-stream"), (key, result)
        data = result["data"]
        assert data[-1] == "[DONE]", (key, data[-3:])
        error = json.loads(data[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error", (key, error)
        assert set(error) == {"message", "type", "code", "param"}
    assert len(results["running"]["data"]) > 2  # tokens came before the error
    assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr
