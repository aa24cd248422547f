"""Shutdown (a real SIGTERM to a real process) and the governor seam."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx

from tests.server.fakes import FakeGovernor
from tests.server.processes import free_port

SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from server.launch import serve
    from server.settings import Settings
    from tests.server.fakes import ScriptedEngine
    settings = Settings(port=int(sys.argv[1]), home=sys.argv[2], model="scripted-test", log_json=True)
    serve(settings, engine_factory=lambda: ScriptedEngine(token_delay_s=0.01, reply_tokens=100_000))
    """
)


def test_serve_when_sigterm_during_stream_then_error_chunk_done_and_exit_within_5s(tmp_path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(port), str(tmp_path)],
        cwd=os.getcwd(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/health")
                if r.status_code == 200 and r.json()["status"] == "ok":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            sent_at = time.monotonic()
            data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "server_shutting_down"
        proc.wait(timeout=5)
        assert time.monotonic() - sent_at < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_stream_when_governor_publishes_and_client_opted_in_then_governor_event(live) -> None:
    gov = FakeGovernor()
    srv = live(governor=gov, token_delay_s=0.002, reply_tokens=100)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    with (
        srv.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**body, "governor_events": True}) as r,
    ):
        lines = list(r.iter_lines())
    i = lines.index("event: governor")
    assert json.loads(lines[i + 1].removeprefix("data: ")) == {"level": "moderate", "reason": "test"}
    assert "data: [DONE]" in lines
    assert gov.steps >= 10


def test_stream_when_governor_publishes_and_client_did_not_opt_in_then_plain_openai_stream(live) -> None:
    gov = FakeGovernor()
    srv = live(governor=gov, token_delay_s=0.002, reply_tokens=100)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = list(r.iter_lines())
    assert gov.steps >= 3
    assert not any(line.startswith("event:") for line in lines)


def test_cli_serve_when_public_host_without_key_then_refuses_with_exit_2(tmp_path, capsys) -> None:
    from server.cli.serve import cli_serve
    from server.settings import Settings

    code = cli_serve(["--host", "0.0.0.0", "--port", "1"], Settings(home=tmp_path, api_key=None))
    assert code == 2
    assert "API key" in capsys.readouterr().err
