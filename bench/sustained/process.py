"""The server under test as a child process (`simmer serve` as a user starts it, with the socket audit),
so the simulated device is heated by the server's CPU time alone, not by the benchmark's client."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from pydantic import SecretStr

from bench.sustained.audit import install_socket_audit
from server.settings import Settings


def _child_main() -> None:
    """Entry point of the child: audit hook, then `simmer serve` with the governed engine factory."""
    audit_fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    model_dir = sys.argv[2] or None
    install_socket_audit(lambda line: os.write(audit_fd, (line + "\n").encode()))
    from server.launch import build_server, gate_for
    from server.logs import setup_logging
    from server.serving.model_setup import serve_folders, serve_store

    settings = Settings()
    setup_logging(settings.log_level, json_lines=False)
    served = serve_folders(settings, [Path(model_dir)]) if model_dir else serve_store(settings)
    build_server(settings, served=served, governor=gate_for(settings, served)).run()


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
    settings: Settings, *, model_dir: Path | None = None, ready_timeout_s: float = 120.0, loaded: bool = True
) -> Iterator[ServerProcess]:
    """Start `simmer serve` (with a socket audit) on a free loopback port; wait until /health answers 200
    and, with `loaded`, says "ok" (the start model loaded: it answers 200 "loading" from the start).
    `cold_start_s`: how long that took."""
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    tmp = Path(tempfile.mkdtemp(prefix="simmer-bench-"))
    audit_path = tmp / "audit.log"
    env = {**os.environ, **settings_env(settings)}  # the child inherits PATH etc., plus our settings
    code = "from bench.sustained.process import _child_main; _child_main()"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(audit_path), str(model_dir or "")],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # the repository (bench/sustained/process.py)
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "server.log").open("w"),
    )
    url = f"http://127.0.0.1:{settings.port}"

    def healthy() -> bool:
        r = httpx.get(url + "/health", timeout=2)
        if r.status_code != 200 and r.json().get("status") == "error":
            raise RuntimeError(f"the model failed to load: {r.json().get('error')}")
        return r.status_code == 200 and (not loaded or r.json().get("status") == "ok")

    try:
        wait_until_ready(proc, healthy, "the server", tmp / "server.log", ready_timeout_s, poll_s=0.05)
        yield ServerProcess(url, proc, audit_path, time.monotonic() - t0, tmp / "server.log")
    finally:
        stop(proc)


def wait_until_ready(
    proc: subprocess.Popen,
    ready: Callable[[], bool],
    what: str,
    log: Path,
    timeout_s: float,
    *,
    poll_s: float,
) -> None:
    """Until `ready()` (an HTTP error: not yet); an error if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen) -> None:
    """Terminate, and kill what does not stop within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_cpu_s(srv: ServerProcess) -> float:
    """User + system CPU seconds of the server process so far (all its threads)."""
    try:
        t = psutil.Process(srv.proc.pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system
