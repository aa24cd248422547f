"""The sliding window with a summary (serving/summary.py) through the real worker and HTTP, on tiny real
models: the first truncated request is served the plain window and queues the summary; after an idle moment
the same conversation carries it (summarized: true, the note in the prompt: its token count); the setting
turns it off; without a chat model it never happens; a request that arrives mid-summary preempts it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from governor.governor import Governor
from governor.sensors import BatteryReading
from models.errors import InvalidParameter
from models.protocol import EngineLimits
from models.runtime.engine import window_split
from server.serving.contracts import NoGate
from server.serving.governor_gate import GovernorGate
from server.serving.model_setup import serve_folders
from server.serving.summary import NOTE_MARK, message_line, prefix_keys, with_note
from tests.server.conftest import make_settings, wait_ready
from tests.server.serving.helpers import TEXT_ONLY, conversation

MAX_TOKENS = 4


def wait_idle(srv, timeout: float = 60.0) -> None:
    """Until the summarizer has nothing pending and the worker is idle."""
    rt = srv.app.state.runtime
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with rt.summarizer._lock:  # pending() and running change together under the lock... or nearly:
            quiet = not rt.summarizer.pending() and not rt.summarizer.running
        if quiet and not rt.worker.busy:
            time.sleep(0.05)  # run() may be about to start
            if not rt.summarizer.pending() and not rt.summarizer.running and not rt.worker.busy:
                return
        time.sleep(0.02)
    raise AssertionError("the summary work did not finish")


@pytest.fixture
def start_pair_server(live, tmp_path, tiny_pair_dirs, tiny_base_model_dir):
    """start(**settings) -> a live server over tiny-big, tiny-small and tiny-base (context 256)."""

    def start(governor=None, **overrides):
        # which models are loaded is part of what these tests set up: no stand-in loads at start
        overrides = {"model": "tiny-small", "context_length": 256, "cold_start": "wait", **overrides}
        settings = make_settings(tmp_path, **overrides)
        served = serve_folders(settings, [*tiny_pair_dirs, tiny_base_model_dir])
        srv = live(served=served, governor=governor, **overrides)
        wait_ready(srv)
        summarizer = srv.app.state.runtime.summarizer
        if summarizer is not None:
            summarizer.sampling = TEXT_ONLY
        return srv

    return start


def chat(srv, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "truncate": True, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream_last(srv, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "truncate": True}
    body["stream"] = True
    final = None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                    final = chunk
    assert final is not None
    return final


def noted_prompt_tokens(srv, messages: list[dict]) -> int:
    """What the prompt of `messages` is with the stored summary as its note, rendered by the serving engine:
    the window over the turns after the summarized prefix."""
    rt = srv.app.state.runtime
    system, turns = window_split(messages)
    found = rt.summarizer.store.longest(prefix_keys(turns[:-1]))
    assert found is not None
    j, text = found
    engine = rt.served.pool.engine("tiny-small")
    return len(engine.chat_prompt(with_note(system + turns[j:], text), truncate=True, reserve=MAX_TOKENS).ids)


def test_summary_when_another_salt_resends_the_turns_then_no_summary_and_the_same_prompt_as_a_guess(
    start_pair_server,
):
    """A summary is an oracle across clients unless it is scoped as the prefix cache is: alice's turns
    (a secret in the first) are summarized; mallory resends them under her own salt, once with the right
    secret and once with a wrong one, and both are served the plain window, alike. Alice, and a salt-less
    request, are not mixed up either; alice again finds hers."""
    srv = start_pair_server()
    secret = conversation()
    secret[1] = {"role": "user", "content": "turn 0: my bank PIN is 4719 " + "the cat sat on a mat " * 2}
    guess = [*secret[:1], {**secret[1], "content": secret[1]["content"].replace("4719", "4718")}, *secret[2:]]
    alice = {"cache_salt": "alice"}
    assert chat(srv, secret, **alice)["summarized"] is False
    wait_idle(srv)
    assert chat(srv, secret, **alice)["summarized"] is True
    wait_idle(srv)
    right = chat(srv, secret, cache_salt="mallory")
    wrong = chat(srv, guess, cache_salt="mallory")
    assert right["summarized"] is wrong["summarized"] is False
    assert right["usage"]["prompt_tokens"] == wrong["usage"]["prompt_tokens"]
    assert chat(srv, secret)["summarized"] is False  # no salt: the shared scope is another scope
    wait_idle(srv)
    assert chat(srv, secret, **alice)["summarized"] is True


def test_summary_when_turns_dropped_then_first_plain_and_after_idle_summarized(start_pair_server):
    srv = start_pair_server()
    messages = conversation()
    first = chat(srv, messages)
    assert (first["truncated"], first["summarized"]) == (True, False)
    rt = srv.app.state.runtime
    wait_idle(srv)
    assert rt.summarizer.written >= 1
    summary = rt.summarizer.store.longest(prefix_keys(window_split(messages)[1][:-1]))
    assert summary is not None and summary[1]  # a non-empty running summary of a dropped prefix

    second = chat(srv, messages)
    assert (second["truncated"], second["summarized"]) == (True, True)
    noted = noted_prompt_tokens(srv, messages)
    assert second["usage"]["prompt_tokens"] == noted != first["usage"]["prompt_tokens"]
    # the note is in the prompt: the engine renders it inside the system message, under its mark
    engine = rt.served.pool.engine("tiny-small")
    system, turns = window_split(messages)
    rendered = engine.chat_text(with_note(system + turns[summary[0] :], summary[1]))
    assert NOTE_MARK in rendered and summary[1] in rendered

    final = chat_stream_last(srv, messages)  # the stream's final chunk says the same
    assert (final["truncated"], final["summarized"]) == (True, True)


def ollama_lines(srv, path: str, body: dict) -> list[dict]:
    """Ollama's NDJSON lines of a streamed reply, or its one object."""
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def test_summary_when_other_dialects_then_they_report_truncated_and_summarized(start_pair_server):
    """Ollama's last line (and its one object) and the Responses API's finished response (the openai SDK's,
    not streamed and streamed) say what the OpenAI bodies say."""
    srv = start_pair_server()
    messages = conversation()
    chat(srv, messages)
    wait_idle(srv)
    options = {"num_predict": MAX_TOKENS, "temperature": 0}
    for stream in (False, True):
        body = {"model": "tiny-small", "messages": messages, "options": options, "stream": stream}
        lines = ollama_lines(srv, "/api/chat", body)
        assert lines[-1]["done"] is True and (lines[-1]["truncated"], lines[-1]["summarized"]) == (True, True)
        assert all("summarized" not in line for line in lines[:-1])
    # one long prompt: its tokens are dropped, not turns (no summary)
    long_prompt = {"model": "tiny-small", "prompt": "the cat sat " * 200, "options": options, "stream": False}
    (body,) = ollama_lines(srv, "/api/generate", long_prompt)
    assert (body["truncated"], body["summarized"]) == (True, False)
    short = ollama_lines(srv, "/api/generate", {**long_prompt, "prompt": "hi"})
    assert (short[0]["truncated"], short[0]["summarized"]) == (False, False)

    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    args = {"model": "tiny-small", "input": messages[1:], "instructions": messages[0]["content"]}
    args |= {"max_output_tokens": 16, "temperature": 0, "truncation": "auto"}
    response = sdk.responses.create(**args)
    assert (response.model_extra or {}).get("truncated") is True
    assert (response.model_extra or {}).get("summarized") is True
    last = list(sdk.responses.create(**args, stream=True))[-1]  # completed, or incomplete (the length)
    assert last.type in ("response.completed", "response.incomplete")
    assert (last.response.model_extra or {}).get("truncated") is True
    assert (last.response.model_extra or {}).get("summarized") is True


def test_summary_when_conversation_grows_then_summary_still_serves(start_pair_server):
    """The look-ahead: a summary covers more than the first request dropped, so the next request (one turn
    pair more) still finds it."""
    srv = start_pair_server()
    messages = conversation()
    chat(srv, messages)
    wait_idle(srv)
    longer = [*messages, {"role": "assistant", "content": "ok."}, {"role": "user", "content": "and then?"}]
    assert chat(srv, longer)["summarized"] is True


def test_summary_when_prefix_changes_then_not_used(start_pair_server):
    srv = start_pair_server()
    messages = conversation()
    chat(srv, messages)
    wait_idle(srv)
    edited = [messages[0], {"role": "user", "content": "a different first question"}, *messages[2:]]
    body = chat(srv, edited)
    assert (body["truncated"], body["summarized"]) == (True, False)


def test_summary_when_setting_off_then_never(start_pair_server):
    srv = start_pair_server(summary=False)
    messages = conversation()
    assert srv.app.state.runtime.summarizer is None
    assert chat(srv, messages)["summarized"] is False
    time.sleep(0.5)  # an idle moment
    final = chat_stream_last(srv, messages)
    assert (final["truncated"], final["summarized"]) == (True, False)


def test_summary_when_on_battery_then_it_waits_for_the_charger_and_thermal_says_so(start_pair_server):
    """35 % unplugged leaves the level nominal (the battery makes it fair below 20 %), but a summary is heavy
    work nobody waits for: it waits, /v1/thermal names it, and plugging in runs it."""
    battery = [BatteryReading(35.0, False)]
    governor = Governor(usable_cpus=1, poll_s=0.05, read_battery=lambda: battery[0])
    srv = start_pair_server(governor=GovernorGate(governor))
    rt = srv.app.state.runtime
    messages = conversation()
    assert chat(srv, messages)["summarized"] is False
    time.sleep(0.5)  # idle moments pass
    thermal = httpx.get(srv.url + "/v1/thermal").json()
    assert thermal["level"] == "nominal"
    assert thermal["background_work"] == {
        "runs": False,
        "why": "on battery at 35 % (below 50 %)",
        "waiting": ["summary"],
    }
    assert rt.summarizer.pending() and rt.summarizer.written == 0
    battery[0] = BatteryReading(35.0, True)  # the next poll sees the charger and wakes the worker
    wait_idle(srv)
    assert rt.summarizer.written >= 1
    assert httpx.get(srv.url + "/v1/thermal").json()["background_work"]["waiting"] == []
    assert chat(srv, messages)["summarized"] is True


def test_summary_when_no_chat_model_in_ladder_then_never(start_pair_server):
    srv = start_pair_server(
        ladder="tiny-base"
    )  # the ladder's only model is a base model: no one can write a summary
    rt = srv.app.state.runtime
    messages = conversation()
    assert chat(srv, messages)["summarized"] is False
    wait_idle(srv)
    assert rt.summarizer.written == 0 and len(rt.summarizer.store) == 0
    assert chat(srv, messages)["summarized"] is False


def test_summary_when_request_arrives_mid_summary_then_preempted(start_pair_server):
    """The idle work stops at the engine's next step once a job is submitted (the worker cancels its token),
    and resumes at the next idle moment."""
    srv = start_pair_server()
    rt = srv.app.state.runtime
    running = threading.Event()
    seen: dict[str, float] = {}

    def on_step(cancel) -> None:  # the first summary step waits for a request to arrive
        if "cancelled" in seen:
            return
        running.set()
        deadline = time.monotonic() + 30
        while not cancel.cancelled and time.monotonic() < deadline:
            time.sleep(0.001)
        seen["cancelled"] = time.perf_counter()

    rt.summarizer.on_step = on_step
    messages = conversation()
    chat(srv, messages)
    assert running.wait(30), "the summary did not start"
    t0 = time.perf_counter()
    second = chat(srv, messages)  # arrives mid-summary
    latency = time.perf_counter() - t0
    assert "cancelled" in seen  # the request's submission cancelled the idle work...
    assert rt.summarizer.preempted == 1  # ...and the engine stopped the summary at its next step
    assert (second["truncated"], second["summarized"]) == (True, False)
    wait_idle(srv)
    assert rt.summarizer.written >= 1  # resumed when idle again
    third = chat(srv, messages)
    assert third["summarized"] is True
    print(f"request arriving mid-summary answered in {latency * 1000:.1f} ms")


def test_summary_hostile_histories(start_pair_server):
    """Empty messages, tool turns and calls, a huge history: answered, and the pending work stays bounded."""
    from server.serving.summary import PENDING_MAX, SPAN_MESSAGES

    srv = start_pair_server()
    rt = srv.app.state.runtime
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    odd = [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "result " * 40},
        {"role": "user", "content": [{"type": "text", "text": "parts " * 30}]},
        {"role": "assistant", "content": ""},
        *conversation()[1:],
    ]
    assert chat(srv, odd)["truncated"] is True
    wait_idle(srv)
    assert chat(srv, odd)["summarized"] is True
    huge = conversation(turns=2046, size=20)  # 2,048 messages: the most a request may have
    t0 = time.perf_counter()
    assert chat(srv, huge)["truncated"] is True
    print(f"a 2046-turn history answered in {time.perf_counter() - t0:.2f} s")
    with rt.summarizer._lock:  # bounded work, whatever the history
        assert len(rt.summarizer._pending) <= PENDING_MAX
        assert all(len(w.lines) <= SPAN_MESSAGES for w in rt.summarizer._pending)


@pytest.mark.slow
def test_summary_real_smollm2_when_turns_dropped_then_written_and_served(live, tmp_path, smollm2_model_dir):
    """SmolLM2 writes a real summary of the dropped turns (a 256-token window), and the conversation then
    carries it."""
    settings = make_settings(tmp_path, model="smollm2-135m-instruct", context_length=256)
    srv = live(served=serve_folders(settings, [smollm2_model_dir]), model=settings.model, context_length=256)
    wait_ready(srv)
    facts = [
        ("My name is Ada and I live in Lyon.", "Nice to meet you, Ada! Lyon is a lovely city."),
        ("I have a cat called Pixel.", "Pixel is a great name for a cat."),
        ("I work as a baker and start at four.", "That is an early start; bakers work hard."),
        ("My sister Lena is visiting next week.", "I hope you enjoy Lena's visit."),
        ("We plan to hike in the Alps.", "The Alps are beautiful for hiking."),
    ]
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for user, assistant in facts:
        assistant += " Tell me more whenever you like, I am happy to help with anything you need."
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": "What should I pack for the hike?"})
    first = chat(srv, messages)
    assert (first["truncated"], first["summarized"]) == (True, False)
    wait_idle(srv, timeout=300)
    rt = srv.app.state.runtime
    found = rt.summarizer.store.longest(prefix_keys(window_split(messages)[1][:-1]))
    assert found is not None and len(found[1].split()) >= 3  # a real, non-empty summary
    second = chat(srv, messages)
    assert (second["truncated"], second["summarized"]) == (True, True)


def test_summary_when_its_model_is_not_loaded_then_the_loaded_one_writes_and_nothing_loads(start_pair_server):
    """SIMMER_LADDER=tiny-big,tiny-small serving tiny-big: the preferred writer, tiny-small, is not loaded,
    and its load (the pool's opener, slow here: it waits for the test) cannot be interrupted. The idle moment
    loads nothing: the loaded tiny-big writes the summary, and a request submitted meanwhile never waits for
    a load. Once tiny-small is loaded (a request named it), it is the writer."""
    srv = start_pair_server(model="tiny-big", ladder="tiny-big,tiny-small,tiny-base")
    rt = srv.app.state.runtime
    summarizer, pool = rt.summarizer, rt.served.pool
    assert summarizer.models() == ["tiny-small", "tiny-big"]  # the base model at the bottom cannot chat
    assert "tiny-small" not in pool.loaded()
    order: list[str] = []
    release = threading.Event()
    opener = pool.opener

    def slow_opener(entry, variant, limits):
        if entry.id == "tiny-small":
            order.append("load started")
            release.wait(60)
        return opener(entry, variant, limits)

    writers: list[str] = []
    write = summarizer._write

    def watched_write(engine, work, cancel) -> None:
        writers.append(engine.model_id)
        write(engine, work, cancel)

    run = summarizer.run

    def watched_run(models, cancel) -> None:
        run(models, cancel)
        order.append("idle work done")

    pool.opener, summarizer.run, summarizer._write = slow_opener, watched_run, watched_write
    messages = conversation()
    assert chat(srv, messages, model="tiny-big")["summarized"] is False  # queues the summary
    served = threading.Event()

    def second() -> None:
        chat(srv, messages, model="tiny-big")
        order.append("reply")
        served.set()

    deadline = time.monotonic() + 30
    while not order and time.monotonic() < deadline:  # the idle moment (where a load would start)
        time.sleep(0.01)
    assert order, "the idle work did not run"
    client = threading.Thread(target=second)
    client.start()
    served.wait(20)  # a bound for a load that blocks: then it is released below
    order.append("load released")
    release.set()
    client.join(60)
    released = order.index("load released")
    assert "load started" not in order[:released]  # the idle moments loaded nothing...
    assert order.index("reply") < released  # ...so the reply did not wait for the test to end a load
    assert writers and set(writers) == {"tiny-big"} and summarizer.written >= 1
    wait_idle(srv)
    assert chat(srv, messages, model="tiny-big")["summarized"] is True

    writers.clear()
    assert chat(srv, conversation(size=60), model="tiny-small")["model"] == "tiny-small"  # loads it
    wait_idle(srv)
    assert writers and set(writers) == {"tiny-small"}  # the smallest, now loaded, writes the new work


class CapGate(NoGate):
    """A governor seam that caps the context (as the limits table does under heat), nothing else."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def before_job(self, cancel, enqueued_at) -> EngineLimits:
        return EngineLimits(context_cap=self.cap)


def test_summary_when_governor_caps_context_then_dropped_turns_summarized(start_pair_server):
    """Turns dropped because the governor lowered the context cap (the conversation fits the 256 tokens
    configured, not the 160 of the cap) are summarized like the ones `truncate` drops."""
    messages = conversation(turns=4)
    srv = start_pair_server(governor=CapGate(160))
    engine = srv.app.state.runtime.served.pool.engine("tiny-small")
    assert len(engine.chat_prompt(messages, reserve=MAX_TOKENS).ids) < 256  # fits without the cap
    first = chat(srv, messages)
    assert (first["truncated"], first["summarized"]) == (True, False)
    wait_idle(srv)
    second = chat(srv, messages)
    assert (second["truncated"], second["summarized"]) == (True, True)
    assert second["usage"]["prompt_tokens"] <= 160


class MidReplyCapGate(NoGate):
    """The governor lowers the context cap during the first reply (at its `at`-th step: before the prefill,
    then after each token) and keeps it lowered for the jobs after it."""

    def __init__(self, cap: int, at: int = 3) -> None:
        self.cap, self.at, self.steps = cap, at, 0

    def before_job(self, cancel, enqueued_at) -> EngineLimits | None:
        return EngineLimits(context_cap=self.cap) if self.steps >= self.at else None

    def before_step(self, cancel) -> EngineLimits | None:
        self.steps += 1
        return EngineLimits(context_cap=self.cap) if self.steps == self.at else None


def test_summary_when_cap_lowered_mid_reply_then_whole_turns_dropped_and_their_summary_queued(
    start_pair_server,
):
    """The conversation fits the configured 256 tokens, and the governor lowers the cap to 160 during the
    reply: the window drops the oldest turns whole mid-reply (the KV rebuilt from the system message, the
    newest turns and the reply so far), the reply says truncated, and once the client has it the dropped
    turns' summary is queued as the request's window queues it (with its look-ahead). The next idle moment
    writes it, and a later request of the conversation (under the lowered cap) carries it."""
    messages = conversation(turns=4)
    gate = MidReplyCapGate(160)
    srv = start_pair_server(
        governor=gate, max_batch=1
    )  # one reply at a time: the test reads the engine's own KV slot
    rt = srv.app.state.runtime
    engine = rt.served.pool.engine("tiny-small")
    system, turns = window_split(messages)
    n = len(turns)
    assert 160 < len(engine.chat_prompt(messages, reserve=8).ids) < 256  # fits until the cap is lowered
    rt.summarizer.allowed = lambda: False  # the work waits, so the test can read it
    body = chat(srv, messages, max_tokens=8, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 8 and gate.steps > 3  # lowered mid-reply
    assert (body["truncated"], body["summarized"]) == (True, False)

    slot = max(engine._slots, key=lambda s: s.last_used).tokens
    encode = engine.chat_ids  # the window's own encoding (chat_prompt would refuse: the cap is 160 now)
    starts = [k for k in range(1, n) if slot[: len(ids := encode(system + turns[k:]))] == ids]
    assert len(starts) == 1 and turns[starts[0]]["role"] == "user"  # whole turns kept, the system message too
    cut = starts[0]
    assert len(encode(system + turns[cut:])) + 8 <= 160

    # queued once the client has the whole reply: the worker closes the job just after sending its end
    deadline = time.monotonic() + 20
    while not rt.summarizer._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    with rt.summarizer._lock:
        (work,) = rt.summarizer._pending
    keys = prefix_keys(turns[: n - 1])
    lines = [line for _, line in work.lines]
    assert work.summary == "" and lines[:cut] == [message_line(t) for t in turns[:cut]]  # every dropped turn
    target = len(lines)  # ...then the look-ahead: up to a user turn, never the question
    assert cut <= target < n and turns[target]["role"] == "user" and work.lines[-1][0] == keys[target - 1]

    rt.summarizer.allowed = lambda: True
    assert chat(srv, [{"role": "user", "content": "hi"}])["truncated"] is False  # an idle moment after it
    wait_idle(srv)
    assert rt.summarizer.store.longest(keys) is not None
    later = chat(srv, messages)
    assert (later["truncated"], later["summarized"]) == (True, True)


def metrics(srv) -> dict[str, float]:
    """/metrics' summary and window samples (name -> value)."""
    text = httpx.get(srv.url + "/metrics", timeout=5).text
    assert "the cat sat" not in text  # numbers, never text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "summar" in sample.name or "truncated" in sample.name
    }


def test_metrics_when_summaries_written_preempted_failed_then_counted(start_pair_server):
    srv = start_pair_server()
    rt = srv.app.state.runtime
    zero = metrics(srv)
    assert zero["simmer_summaries_written_total"] == 0 and zero["simmer_truncated_replies_total"] == 0
    assert chat(srv, [{"role": "user", "content": "hi"}])["truncated"] is False
    messages = conversation()
    chat(srv, messages)
    wait_idle(srv)
    after = metrics(srv)
    assert after["simmer_truncated_replies_total"] == 1 and after["simmer_summarized_replies_total"] == 0
    assert after["simmer_summaries_written_total"] == rt.summarizer.written >= 1
    assert after["simmer_summaries_stored"] == len(rt.summarizer.store) >= 1
    assert after["simmer_summaries_pending"] == 0
    assert chat(srv, messages)["summarized"] is True
    after = metrics(srv)
    assert after["simmer_truncated_replies_total"] == 2 and after["simmer_summarized_replies_total"] == 1

    # a preempted piece: the first step of the next summary waits for a request to arrive
    def on_step(cancel) -> None:
        deadline = time.monotonic() + 30
        while not cancel.cancelled and time.monotonic() < deadline:
            time.sleep(0.001)
        rt.summarizer.on_step = None

    rt.summarizer.on_step = on_step
    other = conversation(turns=12)  # another conversation: new work
    other[1]["content"] = "another first question " * 3
    chat(srv, other)
    for _ in range(500):
        if rt.summarizer.running:
            break
        time.sleep(0.01)
    chat(srv, [{"role": "user", "content": "hi"}])
    wait_idle(srv)
    assert metrics(srv)["simmer_summaries_preempted_total"] == rt.summarizer.preempted == 1

    # a failed piece: the engine refuses the summary's prompt
    def refuse(*args, **kwargs):
        raise InvalidParameter("refused")

    rt.summarizer._generate = refuse
    third = conversation(turns=12)
    third[1]["content"] = "a third first question " * 3
    chat(srv, third)
    wait_idle(srv)
    assert metrics(srv)["simmer_summaries_failed_total"] == rt.summarizer.failed == 1
