"""A real upstream for the routing tests: a second simmer process on the tiny model (upstream_child.py),
behind a TCP proxy that counts connections; and the local simmer under test, in-process, pointed at it."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from models.runtime.engine import load_engine
from tests.server.routing.proxy import CountingProxy

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM_KEY = "sk-upstream-" + secrets.token_hex(12)  # what the local simmer must never log or echo
MODEL = "tiny-llama"  # the tiny converted model's id, on both sides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class UpstreamProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """A counter or gauge from the upstream's /metrics (0 when absent)."""
        text = httpx.get(
            self.url + "/metrics", headers={"Authorization": f"Bearer {self.key}"}, timeout=5
        ).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        key = f"{name}{{{want}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_upstream(
    model_dir: Path | None,
    home: Path,
    *,
    pace: float = 0.0,
    key: str = UPSTREAM_KEY,
    model: str = MODEL,
    **settings: str,
) -> UpstreamProcess:
    """A second simmer on the tiny model at `model_dir` (paced), or with `model_dir` None on the store at
    `home` (`model` its default; `settings` more SIMMER_* variables, by their lower-case names)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIMMER_") or k == "SIMMER_TEST_CACHE"}
    env.update(
        {
            "SIMMER_HOME": str(home),
            "SIMMER_MODEL": model,
            "SIMMER_HOST": "127.0.0.1",
            "SIMMER_PORT": str(port),
            "SIMMER_API_KEY": key,
            "SIMMER_KEEP_ALIVE_S": "0",
            "SIMMER_LOG_LEVEL": "info",
            **{f"SIMMER_{name.upper()}": value for name, value in settings.items()},
        }
    )
    log_path = home / f"upstream-{port}.log"
    args = ["store"] if model_dir is None else [str(model_dir), str(pace)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.routing.upstream_child", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
    )
    upstream = UpstreamProcess(proc, port, log_path, key)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the upstream exited: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(upstream.url + "/health", timeout=2)
            if r.status_code == 200 and r.json()["status"] == "ok":  # its model loaded
                return upstream
        if time.monotonic() > deadline:
            upstream.stop()
            raise RuntimeError(f"the upstream did not become ready: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def upstream(tiny_model_dir, tmp_path_factory) -> Iterator[UpstreamProcess]:
    """Shared by the tests that leave it running; paced so a reply of a few tokens is still quick."""
    proc = start_upstream(tiny_model_dir, tmp_path_factory.mktemp("upstream"), pace=400)
    yield proc
    proc.stop()


@pytest.fixture
def proxy(upstream) -> Iterator[CountingProxy]:
    p = CountingProxy(upstream.port).start()
    yield p
    p.stop()


@pytest.fixture
def local(live, tiny_model_dir, proxy) -> Callable[..., object]:
    """local(**settings) -> a LiveServer on the tiny model whose upstream is `proxy` (route auto unless
    given). `engine=`/`governor=`/`breaker=` pass through to the app."""

    def make(**overrides):
        engine = overrides.pop("engine", None) or load_engine(
            tiny_model_dir, variant="q4", threads=1, context_length=256
        )
        settings = {
            "model": MODEL,
            "route": "auto",
            "upstream_url": proxy.url + "/v1",
            "upstream_api_key": UPSTREAM_KEY,
            **overrides,
        }
        return live(engine=engine, **settings)

    return make
