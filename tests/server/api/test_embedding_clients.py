"""Embedding clients nobody here wrote, against a live server over a tiny sentence encoder installed by the
store: langchain-openai's OpenAIEmbeddings and litellm's embedding() (its `openai/` and `ollama/`
providers) get the vectors /v1/embeddings answers, in order."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

# litellm fetches its model price map from the network at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from langchain_openai import OpenAIEmbeddings

from tests.server.api.embedding_store import ENCODER, encoder_home, encoder_server

# litellm's own models warn as pydantic builds them (its code, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:Item.*ReadOnly:UserWarning")

TEXTS = ["the dog ran", "a red mat", "hello world"]


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    return encoder_home(tmp_path_factory.mktemp("encoder"), tiny_gguf)[0]


@pytest.fixture
def srv(live, tmp_path, home):
    return encoder_server(live, tmp_path, home)


def vectors(srv, texts: list[str]) -> np.ndarray:
    r = httpx.post(srv.url + "/v1/embeddings", json={"model": ENCODER, "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def test_langchain_embeddings_when_documents_and_query_then_the_served_vectors(srv) -> None:
    # check_embedding_ctx_length off: it would tokenize with tiktoken (OpenAI's own vocabulary, fetched from
    # the network) before sending; every guide to a local OpenAI-compatible server turns it off.
    emb = OpenAIEmbeddings(
        model=ENCODER,
        base_url=srv.url + "/v1",
        api_key="unused",  # pyright: ignore[reportArgumentType]
        check_embedding_ctx_length=False,
        chunk_size=2,  # three texts in two requests: the order across requests must hold
    )
    want = vectors(srv, TEXTS)
    assert np.abs(np.array(emb.embed_documents(TEXTS)) - want).max() < 1e-6
    assert np.abs(np.array(emb.embed_query(TEXTS[1])) - want[1]).max() < 1e-6


@pytest.mark.parametrize("provider", ["openai", "ollama"])
def test_litellm_embedding_when_each_provider_then_the_served_vectors(srv, provider: str) -> None:
    base = srv.url + "/v1" if provider == "openai" else srv.url
    got = litellm.embedding(model=f"{provider}/{ENCODER}", input=TEXTS, api_base=base, api_key="unused")
    rows = sorted(got.data, key=lambda d: d["index"])
    assert np.abs(np.array([d["embedding"] for d in rows]) - vectors(srv, TEXTS)).max() < 1e-6
    if provider == "openai":
        assert got.usage is not None and got.usage.prompt_tokens == 14  # [CLS] 3+3+2 words [SEP], each


def test_litellm_embedding_when_a_chat_model_then_bad_request_naming_its_kind(srv) -> None:
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.embedding(
            model=f"openai/{srv.chat_model}", input=["x"], api_base=srv.url + "/v1", api_key="unused"
        )
    assert "it has no embeddings" in str(info.value)
