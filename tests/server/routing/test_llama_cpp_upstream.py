"""A third-party upstream: llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) on the
real SmolLM2 GGUF, behind a local simmer (tiny model) that routes to it. The client must see simmer's own
output shape, whoever made the text."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.routing.conftest import MODEL, free_port

pytestmark = pytest.mark.slow
REMOTE = "smollm2-on-llama-cpp"  # the id clients use; llama.cpp serves it as "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llama_server(smollm2_gguf, tmp_path_factory):
    try:
        import llama_cpp
        import llama_cpp.server  # noqa: F401
    except ImportError as err:
        pytest.skip(
            f"llama-cpp-python is not installed ({err}): pip install 'llama-cpp-python[server]==0.3.36' "
            "(it compiles llama.cpp, about 5 minutes)"
        )
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf), "--model_alias", "smollm2"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"llama_cpp.server exited: {log.read_text()[-2000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def routed(live, tiny_model_dir, llama_server):
    from models.runtime.engine import load_engine

    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256)
    return live(
        engine=engine,
        model=MODEL,
        route="auto",
        upstream_url=llama_server + "/v1",
        upstream_models={REMOTE: "smollm2"},
    )


def test_llama_cpp_when_upstream_only_model_then_same_shape_as_local(routed, llama_server) -> None:
    client = openai.OpenAI(base_url=routed.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    direct = httpx.post(
        llama_server + "/v1/chat/completions",
        json={"model": "smollm2", "messages": QUESTION, "temperature": 0, "max_tokens": 16},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    # llama.cpp's own greedy text is a near-tie on this question (another CPU's build answered "L'Étoile,
    # ..."): what counts is that simmer relays it unchanged, whatever it is
    assert isinstance(direct, str) and direct

    raw = client.chat.completions.with_raw_response.create(
        model=REMOTE, messages=QUESTION, temperature=0, max_tokens=16
    )
    full = raw.parse()
    assert raw.headers["x-simmer-route"] == "upstream; reason=model"
    assert full.model == REMOTE and full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.content == direct
    assert full.model_extra["route"] == {"served": "upstream", "reason": "model"}
    assert full.usage.completion_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model=REMOTE,
            messages=QUESTION,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct
    assert {c.model for c in chunks} == {REMOTE} and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].model_extra["route"]["served"] == "upstream"

    text = client.completions.create(model=REMOTE, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert text.object == "text_completion" and text.model == REMOTE and text.choices[0].text
    assert text.choices[0].finish_reason == "length"

    # the local model still answers on the device
    local = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert local.model_extra["route"] == {"served": "local", "reason": "offline_first"}
