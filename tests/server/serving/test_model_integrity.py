"""A corrupted model is not served: one byte of weights.data flipped in the current version of a real
(tiny) model, then the server starts through the real store and engine factory. The previous version
serves, /health and `simmer list` show the problem and the fix; with no good version left, the error says
which file and what to run."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from models.convert import pipeline
from models.store.store import Converter, ModelStore
from server.cli import main as cli
from server.serving.engine_config import EngineConfig
from server.settings import Settings

MODEL = "tiny"


def converter(version: int) -> Converter:
    return Converter(
        functools.partial(pipeline.convert, measure=False, threads=1), pipeline.smoke_test, version, True
    )


@pytest.fixture(scope="module")
def template(tmp_path_factory, tiny_gguf) -> tuple[Path, str, str]:
    home = tmp_path_factory.mktemp("integrity") / "home"
    old = ModelStore(home, converter=converter(1)).pull(str(tiny_gguf)).version
    new = ModelStore(home, converter=converter(2)).pull(str(tiny_gguf)).version
    return home, old, new


@pytest.fixture
def installed(template, tmp_path) -> tuple[Path, str, str]:
    home, old, new = template
    shutil.copytree(home, tmp_path / "home")
    return tmp_path / "home", old, new


def flip_weights_byte(home: Path, version: str, *, keep_times: bool) -> None:
    path = home / "models" / MODEL / version / "weights.data"
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 3)
        b = f.read(1)[0]
        f.seek(st.st_size // 3)
        f.write(bytes([b ^ 0x01]))
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def settings_for(home: Path) -> Settings:
    return Settings(home=home, model=MODEL, threads=1, context_length=128, keep_alive_s=-1)


@pytest.mark.parametrize("keep_times", [False, True], ids=["mtime-changed", "mtime-restored"])
def test_serve_when_current_weights_corrupted_then_previous_serves_and_health_says_so(
    live, installed, tiny_gguf, caplog, capsys, keep_times
) -> None:
    home, old, new = installed
    flip_weights_byte(home, new, keep_times=keep_times)
    settings = settings_for(home)
    caplog.set_level(logging.WARNING, logger="simmer.store")
    srv = live(
        engine_factory=lambda: EngineConfig.from_settings(settings).open_installed(settings.model),
        home=home,
        model=MODEL,
    )
    with srv.client() as c:
        for _ in range(500):
            health = c.get("/health").json()
            if health["status"] != "loading":
                break
            time.sleep(0.02)
        assert health["status"] == "ok"
        engine = srv.app.state.runtime.served.pool.engine(MODEL)
        assert engine is not None
        assert engine.model_dir == home / "models" / MODEL / old  # the previous version serves
        problem = health["model_problem"]
        assert problem["version"] == new and problem["serving_version"] == old
        assert problem["files"] == ["weights.data"]
        assert problem["fix"] == f"simmer pull --force {tiny_gguf}"
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    logged = [r.getMessage() for r in caplog.records if r.name == "simmer.store"]
    assert any(f"{new} is marked bad" in m and "weights.data (sha256" in m for m in logged)
    assert any(f"serving the previous version {old}" in m for m in logged)

    assert cli.main(["list"], settings=settings) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[1]: line for line in out[1:] if line.startswith(MODEL + " ")}
    assert "BAD: weights.data changed after it was verified" in rows[new]
    assert rows[old].endswith("serving (the current version is bad)")
    assert any(f"to fix: simmer pull --force {tiny_gguf}" in line for line in out)


def test_serve_when_no_good_version_then_health_error_names_file_and_fix(live, installed, tiny_gguf) -> None:
    home, old, new = installed
    flip_weights_byte(home, new, keep_times=False)
    flip_weights_byte(home, old, keep_times=False)
    settings = settings_for(home)
    srv = live(
        engine_factory=lambda: EngineConfig.from_settings(settings).open_installed(settings.model),
        home=home,
        model=MODEL,
    )
    for _ in range(500):
        r = httpx.get(srv.url + "/health")
        if r.json()["status"] != "loading":
            break
        time.sleep(0.02)
    body = r.json()
    assert r.status_code == 503 and body["status"] == "error"
    assert "no good version to serve" in body["error"] and "weights.data" in body["error"]
    assert f"simmer pull --force {tiny_gguf}" in body["error"]
    assert body["model_problem"]["version"] == new and body["model_problem"]["serving_version"] is None
    chat = httpx.post(
        srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 503 and "weights.data" in chat.json()["error"]["message"]


def test_pull_force_when_current_bad_then_the_fix_works(installed, tiny_gguf, capsys) -> None:
    """The fix the messages give works: `simmer pull --force <gguf>` installs a good current version."""
    home, old, new = installed
    flip_weights_byte(home, new, keep_times=False)
    settings = settings_for(home)
    assert ModelStore(home).load(MODEL).version == old
    assert cli.main(["pull", "--force", str(tiny_gguf)], settings=settings, converter=converter(2)) == 0
    assert ModelStore(home).load(MODEL).version == new
    assert ModelStore(home).problem(MODEL) is None
    assert cli.main(["verify", MODEL], settings=settings) == 0
