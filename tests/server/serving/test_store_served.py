"""A server over a real model store (`simmer serve`'s serve_store, two tiny models installed): what the
tokenizer routes do once keep_alive unloaded a model, and what /api/delete and a removed model give."""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from models.convert import pipeline
from models.runtime.tokenizer import Tokenizer
from models.store.store import Converter, ModelStore
from server.serving.model_setup import serve_store
from tests.conftest import GEMMA_STYLE_TEMPLATE
from tests.server.conftest import make_settings, wait_ready
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_vocab import FAMILIES, family_metadata

CONVERTER = Converter(
    functools.partial(pipeline.convert, measure=False, threads=1), pipeline.smoke_test, 1, plans_disk=True
)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def template_home(tmp_path_factory, tiny_gguf) -> Path:
    """A store with tiny-a (byte-level BPE, ChatML) and tiny-b (SentencePiece, a Gemma-style template),
    converted once per module."""
    root = tmp_path_factory.mktemp("store-served")
    store = ModelStore(root / "home", converter=CONVERTER)
    shutil.copy(tiny_gguf, root / "tiny-a.gguf")
    write_tiny_gguf(
        root / "tiny-b.gguf",
        matrix_type="Q4_1",
        embed_type="Q8_0",
        seed=3,
        vocabulary=family_metadata(FAMILIES["spm-noprefix"]),
        chat_template=GEMMA_STYLE_TEMPLATE,
        name="tiny-b",
    )
    for name in ("tiny-a", "tiny-b"):
        store.pull(str(root / f"{name}.gguf"))
    return root / "home"


@pytest.fixture
def serve(live, template_home, tmp_path) -> Iterator:
    """serve(**settings) -> a live server over a copy of the store, tiny-a the default, ready."""
    home = tmp_path / "home"
    shutil.copytree(template_home, home)

    def start(**overrides):
        overrides = {"home": home, "model": "tiny-a", "context_length": 128, "threads": 1, **overrides}
        srv = live(served=serve_store(make_settings(tmp_path, **overrides)), **overrides)
        wait_ready(srv)
        return srv

    yield start


def loaded(srv) -> set[str]:
    return {m["model"].removesuffix(":latest") for m in httpx.get(srv.url + "/api/ps").json()["models"]}


def wait_unloaded(srv, model: str) -> None:
    for _ in range(500):
        if model not in loaded(srv):
            return
        time.sleep(0.02)
    raise AssertionError(f"{model} is still loaded")


# ---- the tokenizer routes load the tokenizer of the model they are asked about ---------------------------


def test_tokenizer_routes_when_keep_alive_unloaded_the_model_then_answered_from_its_tokenizer(serve) -> None:
    srv = serve(keep_alive_s=0)  # unload after each reply
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        before = c.post("/tokenize", json={"content": "Hello world"}).json()
        prompt_before = c.post("/apply-template", json={"messages": HI}).json()
        assert c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200
        wait_unloaded(srv, "tiny-a")
        assert c.get("/health").json()["status"] == "ok"
        after = c.post("/tokenize", json={"content": "Hello world"})
        assert after.status_code == 200, after.text
        assert after.json() == before
        assert c.post("/apply-template", json={"messages": HI}).json() == prompt_before
        text = c.post("/detokenize", json={"tokens": before["tokens"]})
        assert text.status_code == 200 and text.json() == {"content": "Hello world"}
    assert loaded(srv) == set()  # the tokenizer alone: no model was loaded for it


def test_tokenizer_routes_when_a_model_that_is_not_loaded_is_named_then_its_own_tokenizer_answers(
    serve, tmp_path
) -> None:
    srv = serve()
    assert loaded(srv) == {"tiny-a"}
    own = Tokenizer.load(ModelStore(tmp_path / "home").load("tiny-b").path)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/tokenize", json={"content": "Hello world", "model": "tiny-b"})
        assert r.status_code == 200 and r.json()["tokens"] == own.encode(
            "Hello world", add_special_tokens=False
        )
        assert r.json() != c.post("/tokenize", json={"content": "Hello world"}).json()  # not tiny-a's
        prompt = c.post("/apply-template", json={"messages": HI, "model": "tiny-b"}).json()["prompt"]
        assert prompt.startswith("<start_of_turn>user")
        missing = c.post("/tokenize", json={"content": "Hello", "model": "tiny-z"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert loaded(srv) == {"tiny-a"}


# ---- deleting: any installed model that is not in use; a removed model is not found ---------------------


def test_api_delete_when_installed_and_neither_default_nor_loaded_then_deleted(serve) -> None:
    srv = serve()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.request("DELETE", "/api/delete", json={"model": "tiny-b"})
        assert r.status_code == 200, r.text
        names = [m["model"] for m in c.get("/api/tags").json()["models"]]
        assert "tiny-b:latest" not in names and "tiny-a:latest" in names
        default = c.request("DELETE", "/api/delete", json={"model": "tiny-a"})
        assert default.status_code == 400 and "SIMMER_MODEL" in default.json()["error"]
        gone = c.request("DELETE", "/api/delete", json={"model": "tiny-b"})
        assert gone.status_code == 404


def test_api_delete_when_loaded_then_refused_until_it_unloads(serve) -> None:
    srv = serve()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"model": "tiny-b", "messages": HI, "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert "tiny-b" in loaded(srv)
        r = c.request("DELETE", "/api/delete", json={"model": "tiny-b"})
        assert r.status_code == 400 and "loaded" in r.json()["error"], r.text
        assert (
            c.post(
                "/api/generate",
                json={
                    "model": "tiny-b",
                    "keep_alive": 0,
                    "prompt": "x",
                    "stream": False,
                    "options": {"num_predict": 1},
                },
            ).status_code
            == 200
        )
        wait_unloaded(srv, "tiny-b")
        assert c.request("DELETE", "/api/delete", json={"model": "tiny-b"}).status_code == 200


def test_chat_when_the_loaded_model_was_removed_by_the_cli_then_404_not_model_not_chat(
    serve, tmp_path
) -> None:
    srv = serve()
    body = {"model": "tiny-b", "messages": HI, "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200  # tiny-b loaded, ran last
        ModelStore(tmp_path / "home").remove("tiny-b")  # what `simmer rm tiny-b` does
        time.sleep(2.5)  # the catalog reads the store again at most every 2 s
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] in ("model_not_found", "model_not_installed")
        ollama = c.post("/api/chat", json={**body, "stream": False})
        assert ollama.status_code == 404, ollama.text
