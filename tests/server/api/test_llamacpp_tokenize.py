"""llama.cpp server's /tokenize, /detokenize and /apply-template: its JSON, and ids equal to the engine's.

The tiny real model (byte-level BPE, a ChatML template) checks the ids; the scripted engine (ids are code
points, a surrogate id stands for bytes that are no UTF-8) checks the shapes and the bytes of a piece.
"""

from __future__ import annotations

import threading

import pytest

from models.runtime.engine import load_engine
from server.serving.contracts import NoGate
from tests.server.conftest import MODEL
from tests.server.fakes import RecordingEngine

TEXT = "Hello world, héllo 世界 🙂 <|im_start|>"


@pytest.fixture
def tiny_server(live, tiny_model_dir):
    engine = RecordingEngine(load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256))
    return live(engine=engine, model=engine.model_id), engine


@pytest.mark.parametrize("add_special", [False, True])
@pytest.mark.parametrize("parse_special", [False, True])
def test_tokenize_when_real_model_then_ids_equal_the_engines(tiny_server, add_special, parse_special) -> None:
    srv, engine = tiny_server
    body = {"content": TEXT, "add_special": add_special, "parse_special": parse_special}
    with srv.client() as c:
        r = c.post("/tokenize", json=body)
    assert r.status_code == 200 and set(r.json()) == {"tokens"}
    expected = engine.inner.tokenizer.encode(
        TEXT, add_special_tokens=add_special, parse_special=parse_special
    )
    assert r.json()["tokens"] == expected
    special = engine.inner.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert (special[0] in expected) == (parse_special and len(special) == 1)


def test_tokenize_when_with_pieces_then_id_and_piece_and_bytes_for_partial_characters(tiny_server) -> None:
    srv, engine = tiny_server
    with srv.client() as c:
        tokens = c.post("/tokenize", json={"content": TEXT, "with_pieces": True}).json()["tokens"]
        ids = c.post("/tokenize", json={"content": TEXT}).json()["tokens"]
    assert [t["id"] for t in tokens] == ids
    raw = b""
    for t in tokens:
        piece = t["piece"]
        # llama.cpp: a string when the piece is valid UTF-8, else its bytes
        data = piece.encode() if isinstance(piece, str) else bytes(piece)
        assert data == engine.inner.tokenizer.token_bytes(t["id"])
        raw += data
    assert raw.decode() == TEXT
    assert any(isinstance(t["piece"], list) for t in tokens)  # the emoji is split across byte tokens


def test_detokenize_when_ids_then_the_text_back(tiny_server) -> None:
    srv, _ = tiny_server
    with srv.client() as c:
        ids = c.post("/tokenize", json={"content": TEXT}).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"content": TEXT}
        assert c.post("/detokenize", json={}).json() == {"content": ""}
        bad = c.post("/detokenize", json={"tokens": [1, 10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
        neg = c.post("/detokenize", json={"tokens": [-1]})
        assert neg.status_code == 400


def test_apply_template_when_messages_then_the_prompt_chat_completions_feeds_the_model(tiny_server) -> None:
    srv, engine = tiny_server
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi <|im_end|> there"},  # special-token text inside content stays text
    ]
    with srv.client() as c:
        prompt = c.post("/apply-template", json={"messages": messages}).json()["prompt"]
        assert prompt.startswith("<|im_start|>system\nbe brief") and prompt.endswith(
            "<|im_start|>assistant\n"
        )
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200
        fed = engine.generations[-1].prompt.ids
        # the same text; the template's markup tokenized as specials, the message's as text
        assert engine.inner.tokenizer.decode(fed, skip_special_tokens=False) == prompt
        plain = [*messages[:1], {"role": "user", "content": "hi there"}]
        prompt = c.post("/apply-template", json={"messages": plain}).json()["prompt"]
        c.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 1})
        ids = c.post("/tokenize", json={"content": prompt, "parse_special": True}).json()["tokens"]
    assert ids == engine.generations[-1].prompt.ids


def test_tokenize_when_mixed_content_then_strings_and_ids_as_llamacpp(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/tokenize", json={"content": ["ab", 7, "c"], "with_pieces": False})
    assert r.json() == {"tokens": [97, 98, 7, 99]}


def test_tokenize_when_scripted_then_surrogate_piece_is_its_bytes(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/tokenize", json={"content": ["a", 0xD800], "with_pieces": True})
        assert r.json() == {"tokens": [{"id": 97, "piece": "a"}, {"id": 0xD800, "piece": [0xED, 0xA0, 0x80]}]}
        assert c.post("/apply-template", json={"messages": [{"role": "user", "content": "x"}]}).json() == {
            "prompt": "<user>x\n<assistant>"
        }


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"content": 5}, 400, "content"),
        ("/tokenize", {"content": "x", "add_special": "yes"}, 400, "add_special"),
        ("/tokenize", {"content": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
        ("/apply-template", {"messages": []}, 400, "messages"),
        ("/apply-template", {"messages": [{"role": "x", "content": "y"}]}, 400, "messages[0].role"),
    ],
)
def test_tokenizer_endpoints_when_bad_input_then_400_naming_the_field(
    live, path, body, status, param
) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


class HoldGate(NoGate):
    """A worker gate that holds the running reply until released (the governor's pause seam)."""

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.release = threading.Event()

    def before_job(self, cancel, enqueued_at):
        return None

    def before_step(self, cancel):
        self.holding.set()
        self.release.wait(30)
        return None


def test_tokenize_when_the_worker_is_busy_then_answered_without_waiting(live) -> None:
    """The tokenizer runs beside the worker: a reply held on the worker does not hold /tokenize back."""
    gate = HoldGate()
    srv = live(governor=gate)
    replies: list[int] = []

    def generate() -> None:
        with srv.client() as c:
            replies.append(
                c.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
                ).status_code
            )

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    try:
        assert gate.holding.wait(10)
        with srv.client() as c:
            r = c.post("/tokenize", json={"content": "x" * 100_000, "model": MODEL})
        assert r.status_code == 200 and len(r.json()["tokens"]) == 100_000
        assert replies == []  # the reply is still held on the worker
    finally:
        gate.release.set()
        worker.join(10)
    assert replies == [200]
