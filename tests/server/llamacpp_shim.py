"""A pytest plugin for llama.cpp's own server unit tests (`tools/server/tests/unit` of the llama-cpp-python
sdist), loaded with `-p tests.server.llamacpp_shim` by tests/server/api/test_llamacpp_server_tests.py,
which runs them in a subprocess. Their `ServerProcess.start()` launches llama-server; here it starts
simmer instead, in this process, on a free port, serving the model folder SIMMER_SHIM_MODEL_DIR names.
Which cases apply, and why the others do not: tests/server/llamacpp_cases.py (its collection hook runs here).

Their requests go to OpenAI's chat and Responses routes without the /v1 prefix, which llama-server also
serves: the shim adds it. The server settings a case sets map to simmer's: `api_key`, `temperature` (the
default sampling temperature), `n_ctx` (the engine's context). `n_predict`, llama-server's default reply
length, has no simmer setting: a reply without max_tokens runs to its end or the context's."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

# llama.cpp's utils.py imports wget for download_file(), which no selected case calls.
sys.modules.setdefault("wget", types.ModuleType("wget"))

import utils  # noqa: E402  (llama.cpp's tests/utils.py: its folder is on sys.path)

from models.runtime.engine import load_engine  # noqa: E402
from tests.server.conftest import make_settings, start_server  # noqa: E402
from tests.server.llamacpp_cases import pytest_collection_modifyitems  # noqa: E402, F401 (the hook)

MODEL_DIR = Path(os.environ.get("SIMMER_SHIM_MODEL_DIR", "."))
HOME = Path(os.environ.get("SIMMER_SHIM_HOME", "."))
DEFAULT_CONTEXT = 512

# ---- ServerProcess -> simmer ------------------------------------------------------------------------

_ENGINES: dict[int, object] = {}
_RUNNING: dict[int, object] = {}  # id(ServerProcess) -> LiveServer


def _engine(context_length: int):
    if context_length not in _ENGINES:
        _ENGINES[context_length] = load_engine(MODEL_DIR, threads=1, context_length=context_length)
    return _ENGINES[context_length]


def start(self, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
    engine = _engine(self.n_ctx or DEFAULT_CONTEXT)
    home = HOME / f"server-{len(_RUNNING)}-{id(self)}"
    home.mkdir(parents=True, exist_ok=True)
    settings = make_settings(
        home,
        model=engine.model_id,
        api_key=self.api_key,
        temperature=self.temperature,
        context_length=self.n_ctx or DEFAULT_CONTEXT,
    )
    srv = start_server(settings, engine=engine)
    host, port = srv.url.removeprefix("http://").split(":")
    self.server_host, self.server_port = host, int(port)
    self.model_alias = engine.model_id  # the name simmer serves it under
    _RUNNING[id(self)] = srv
    utils.server_instances.add(self)
    self.ready = True
    for _ in range(500):  # the engine is loaded: ready at once, as /health says
        if self.make_request("GET", "/health").status_code == 200:
            return
    raise TimeoutError("simmer did not become ready")


def stop(self) -> None:
    utils.server_instances.discard(self)
    srv = _RUNNING.pop(id(self), None)
    if srv is not None:
        srv.stop()


# llama-server answers OpenAI's chat, Responses and models routes with and without the /v1 prefix (its
# /completions is its native completion endpoint); simmer answers them under /v1 only.
_OPENAI_PATHS = ("/chat/completions", "/responses", "/models")
_make_url = utils.ServerProcess.make_url


def make_url(self, path: str, host: str | None = None) -> str:
    if path.startswith(_OPENAI_PATHS):
        path = "/v1" + path
    return _make_url(self, path, host)


utils.ServerProcess.make_url = make_url
utils.ServerProcess.start = start
utils.ServerProcess.stop = stop
utils.ServerPreset.load_all = staticmethod(lambda: None)  # nothing to download
