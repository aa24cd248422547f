"""The HTTP API over the real ONNX engine: the tiny converted model (fast) and SmolLM2 (slow)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from models.runtime.engine import DecoderEngine, load_engine
from tests.helpers import sdk
from tests.margins import WIDE, greedy
from tests.server.fakes import PaceGate, RecordingEngine


@pytest.fixture
def tiny_server(live, tiny_model_dir):
    engine = RecordingEngine(load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128))
    return live(engine=engine, model=engine.model_id)


def test_real_engine_when_streamed_then_same_text_as_non_streamed(tiny_server):
    client = sdk(tiny_server)
    kwargs = dict(
        model=tiny_server.engine.model_id,
        messages=[{"role": "user", "content": "the cat"}],
        temperature=0,
        max_tokens=20,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == full.usage.completion_tokens
    # the second identical request reused the prompt's KV cache
    inner = tiny_server.engine.inner
    assert isinstance(inner, DecoderEngine)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - inner.reuse_tail


def test_real_engine_when_completions_with_seed_then_reproducible(tiny_server):
    client = sdk(tiny_server)
    kwargs = dict(
        model=tiny_server.engine.model_id, prompt="once upon", temperature=1.3, max_tokens=16, seed=11
    )
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_completions_when_the_prompt_is_token_ids_then_the_reply_of_the_text_they_are(tiny_server):
    """OpenAI's prompt as token ids (a list, or a list of one list) runs those ids as given: the same
    reply, logprobs included, as the text they tokenize from; an id outside the vocabulary is a 400 naming
    its position; more than one prompt is a 400."""
    client = sdk(tiny_server)
    inner = tiny_server.engine.inner
    assert isinstance(inner, DecoderEngine)
    ids = inner.text_prompt("once upon a time").ids
    ask = dict(model=inner.model_id, temperature=0, max_tokens=12, logprobs=2)
    inner.reset_cache()
    text = client.completions.create(prompt="once upon a time", **ask)
    for prompt in (list(ids), [list(ids)]):
        inner.reset_cache()
        got = client.completions.create(prompt=prompt, **ask)
        assert got.choices[0].text == text.choices[0].text
        # the same passes; the last bits of a fresh session's first passes may differ
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            text.choices[0].logprobs.token_logprobs, rel=1e-4
        )
        assert got.usage.prompt_tokens == len(ids)
        assert tiny_server.engine.generations[-1].prompt.ids == list(ids)
    for prompt, param in (
        ([1, inner.vocab_size], "prompt[1]"),
        ([[1], [2]], "prompt"),
        ([1, -1], "prompt[1]"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(prompt=prompt, **ask)
        assert err.value.body["param"] == param, err.value.body


def test_real_engine_when_client_disconnects_then_worker_free_for_next(live, tiny_model_dir):
    """A long streamed reply is dropped mid-way; the next request is served at once."""
    engine = RecordingEngine(load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128))
    # the tiny model is too fast to disconnect from in time: pace it, as the governor's gate does
    srv = live(engine=engine, model=engine.model_id, governor=PaceGate(50))
    client = sdk(srv)
    stream = client.chat.completions.create(
        model=srv.engine.model_id,
        stream=True,
        max_tokens=100,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "go on"}],
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    done = threading.Event()

    def follow_up():
        client.chat.completions.create(
            model=srv.engine.model_id, max_tokens=2, messages=[{"role": "user", "content": "next"}]
        )
        done.set()

    threading.Thread(target=follow_up, daemon=True).start()
    assert done.wait(20)
    first = srv.engine.generations[0]
    assert first.finish is not None and first.finish.finish_reason == "cancelled"
    assert first.tokens_at_cancel is not None and first.tokens - first.tokens_at_cancel <= 1
    assert first.finish.usage.completion_tokens < 100


KNOWN_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_real_model_when_openai_sdk_streams_then_the_engines_greedy_text(live, smollm2_model_dir):
    """The default variant (q4-a8) over HTTP, on the known prompt (the capital of France, no BOS): the
    stream and the reply carry the engine's own greedy text; "Paris" is asserted where each step is
    decided on this CPU (tests/margins.py)."""
    engine = load_engine(smollm2_model_dir, threads=2)
    direct = greedy(engine, engine.text_prompt(KNOWN_PROMPT), 32)
    srv = live(engine=engine, model=engine.model_id)
    client = sdk(srv)
    ask = dict(model=engine.model_id, temperature=0, prompt=KNOWN_PROMPT, max_tokens=32)
    stream = client.completions.create(stream=True, **ask)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == client.completions.create(**ask).choices[0].text == direct.text != ""
    if direct.decided(WIDE[engine.variant]):
        assert streamed == "The capital of France is Paris.", direct.margins


@pytest.mark.slow
def test_real_model_when_chat_with_exact_variant_then_the_engines_greedy_text(live, smollm2_model_dir):
    """Through the chat template (default system prompt) the exact q4 variant over HTTP gives the engine's
    own greedy reply; its first token wins by 0.08 logits only, so the words are asserted only where
    decided on this CPU."""
    engine = load_engine(smollm2_model_dir, variant="q4", threads=2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    direct = greedy(engine, engine.chat_prompt(messages), 32)
    client = sdk(live(engine=engine, model=engine.model_id))
    chat = client.chat.completions.create(
        model=engine.model_id, temperature=0, max_tokens=32, messages=messages
    )
    assert chat.choices[0].message.content == direct.text != ""
    if direct.decided(WIDE["q4"]):
        assert direct.text == "The capital of France is Paris."


def test_keep_alive_when_idle_then_model_unloaded_and_loaded_again_on_next_request(live, tiny_model_dir):
    """SIMMER_KEEP_ALIVE_S: an idle model frees its sessions and KV; the next request loads it again."""
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    srv = live(engine=engine, model=engine.model_id, keep_alive_s=0.3)
    client = sdk(srv)
    ask = dict(
        model=engine.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert engine._sessions  # loaded
    deadline = time.monotonic() + 5
    while (engine._sessions or engine._slots) and time.monotonic() < deadline:  # the worker clears one, then
        time.sleep(0.05)  # the other: wait for both
    assert not engine._sessions and not engine._slots  # unloaded after the idle time
    again = client.chat.completions.create(**ask)
    assert again.choices[0].message.content == first
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # the KV cache went with it


def test_real_engine_when_onnxruntime_genai_folder_pulled_then_served_like_ours(
    live, tiny_model_dir, tmp_path
):
    """`simmer pull ./folder` of a foreign-layout folder (separate KV buffers, all-position logits), served
    over the API: the same greedy completion as our own folder with the same decoder."""
    from models.runtime.engine import DecoderEngine
    from models.store.store import ModelStore
    from tests.models import genai_folders as gf

    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "foreign-tiny", share_buffer=False)
    gf.all_position_logits(folder)
    installed = ModelStore(tmp_path / "home").pull(str(folder))
    foreign = DecoderEngine(
        installed.path, installed.manifest, model_id=installed.id, threads=1, context_length=128
    )
    decoder = installed.variants["genai"]["file"].removesuffix(".onnx")
    ours = load_engine(tiny_model_dir, variant=decoder, threads=1, context_length=128)
    texts = []
    for engine in (foreign, ours):
        srv = live(engine=engine, model=engine.model_id)
        reply = sdk(srv).completions.create(
            model=engine.model_id, prompt="once upon", temperature=0, max_tokens=12
        )
        texts.append((reply.choices[0].text, reply.usage.completion_tokens))
    assert texts[0] == texts[1] and texts[0][1] == 12


def test_chat_when_n_choices_then_each_is_the_reply_of_its_own_seed_and_usage_adds_up(tiny_server):
    """n = 3 with seed 5: three choices, choice i the reply a request with seed 5 + i gets alone; the
    completion tokens add up, the prompt counts once. Streamed, each choice's chunks carry its index and
    its text is the same choice's unstreamed; one usage chunk adds them up, then one [DONE]."""
    client = sdk(tiny_server)
    ask = dict(
        model=tiny_server.engine.model_id,
        messages=[{"role": "user", "content": "once upon"}],
        temperature=1.2,
        max_tokens=10,
    )
    both = client.chat.completions.create(n=3, seed=5, **ask)
    assert [c.index for c in both.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(seed=5 + i, **ask) for i in range(3)]
    assert [c.message.content for c in both.choices] == [a.choices[0].message.content for a in alone]
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.model_extra["models"] == {ask["model"]: both.usage.completion_tokens}  # per model too
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens
    text = client.completions.create(model=ask["model"], prompt="once", n=2, max_tokens=4, temperature=0)
    assert [c.index for c in text.choices] == [0, 1] and text.choices[0].text == text.choices[1].text
    streamed: dict[int, str] = {}
    usage = []
    for chunk in client.chat.completions.create(
        n=3, seed=5, stream=True, stream_options={"include_usage": True}, **ask
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        if chunk.usage is not None:
            usage.append(chunk.usage)
    assert streamed == {i: c.message.content for i, c in enumerate(both.choices)}
    assert len(usage) == 1 and usage[0].completion_tokens == both.usage.completion_tokens
    assert usage[0].model_extra["models"] == both.usage.model_extra["models"]
    with httpx.stream(
        "POST",
        f"{tiny_server.url}/v1/completions",
        json={"model": ask["model"], "prompt": "once", "n": 2, "max_tokens": 4, "stream": True},
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    finals = [json.loads(line[6:])["choices"] for line in lines[:-1]]
    assert sorted(c[0]["index"] for c in finals if c and c[0]["finish_reason"]) == [0, 1]
