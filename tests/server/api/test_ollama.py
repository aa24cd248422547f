"""Ollama's API against a live server, with Ollama's own Python client (and raw httpx for the wire details).

Most tests run the scripted engine (its prompt ids are code points, so the prompt a request built can be
read back); the pull test converts a tiny real GGUF.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import httpx
import ollama
import pytest

from governor.governor import Governor
from governor.sensors import BatteryReading
from models.types import GenerationParams
from server.serving.contracts import Job
from server.serving.governor_gate import GovernorGate
from tests.server.conftest import MODEL
from tests.server.fakes import REPLY

WORDS = REPLY.split(" ")
OLLAMA_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def client(srv) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=30)


def ndjson(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


def last_params(srv) -> GenerationParams:
    return srv.engine.generations[-1].params


def prompt_text(srv) -> str:
    return "".join(chr(i) for i in srv.engine.generations[-1].prompt.ids)


def record_jobs(srv) -> list[Job]:
    """The jobs the router hands to the worker (LocalSide.submit is the seam between them)."""
    router = srv.app.state.runtime.router
    jobs: list[Job] = []
    submit = router.local.submit

    def recording(job: Job) -> None:
        jobs.append(job)
        submit(job)

    router.local = dataclasses.replace(router.local, submit=recording)
    return jobs


# ---- generation ---------------------------------------------------------------------------------------


def test_chat_when_not_streamed_then_whole_reply_and_sane_nanosecond_stats(live) -> None:
    srv = live(token_delay_s=0.01)
    r = client(srv).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=False)
    assert r.message.role == "assistant" and r.message.content == REPLY
    assert r.done and r.done_reason == "stop" and r.model == MODEL
    assert r.eval_count == len(WORDS)
    assert r.prompt_eval_count == len("<user>hi\n<assistant>")
    # nanoseconds: 16 tokens 10 ms apart take more than 0.1 s to decode, and the parts fit the whole
    assert r.eval_duration > 100_000_000
    assert r.total_duration >= r.eval_duration + r.prompt_eval_duration
    assert r.total_duration >= r.load_duration >= 0 and r.prompt_eval_duration > 0
    assert r.total_duration < 30 * 10**9
    assert r.created_at.endswith("Z")


def test_chat_when_streamed_by_default_then_ndjson_parts_and_one_final_object(live) -> None:
    srv = live(token_delay_s=0.005)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # no "stream": Ollama streams
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = ndjson(r)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line["message"]["content"] for line in lines) == REPLY
    final = lines[-1]
    assert final["message"] == {"role": "assistant", "content": ""}  # streamed: the text came before
    assert final["done_reason"] == "stop" and final["eval_count"] == len(WORDS)
    for key in (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_duration",
    ):
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert all("done_reason" not in line for line in lines[:-1])


def test_chat_when_ollama_client_streams_then_parts_join_to_the_reply(live) -> None:
    srv = live()
    parts = list(
        client(srv).chat(model=MODEL + ":latest", messages=[{"role": "user", "content": "x"}], stream=True)
    )
    assert "".join(p.message.content for p in parts) == REPLY
    assert parts[-1].done and parts[-1].model == MODEL + ":latest"  # the name as the client gave it


def test_options_when_given_then_mapped_onto_the_sampling_fields(live) -> None:
    srv = live()
    options = {
        "temperature": 0.3,
        "top_k": 7,
        "top_p": 0.5,
        "min_p": 0.1,
        "seed": 42,
        "stop": ["lazy"],
        "repeat_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "num_predict": 5,
        "num_ctx": 4096,  # accepted, not applied
        "mirostat": 2,  # an option simmer does not have: ignored, as Ollama ignores unknown ones
    }
    r = client(srv).generate(model=MODEL, prompt="hi", options=options)
    p = last_params(srv)
    s = p.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.3, 7, 0.5, 0.1, 42)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.2, 0.5, -0.5)
    assert p.stop == ("lazy",) and p.max_tokens == 5 and p.truncate is True  # Ollama truncates by default
    assert r.done_reason == "length" and r.eval_count == 5


@pytest.mark.parametrize(("num_predict", "max_tokens"), [(-1, None), (-2, None), (0, None), (3, 3)])
def test_num_predict_when_negative_or_zero_then_no_cap(live, num_predict, max_tokens) -> None:
    srv = live()
    client(srv).generate(model=MODEL, prompt="hi", options={"num_predict": num_predict})
    assert last_params(srv).max_tokens == max_tokens


def test_seed_when_minus_one_then_a_fresh_draw_as_in_ollama(live) -> None:
    srv = live()
    client(srv).generate(model=MODEL, prompt="hi", options={"seed": -1})
    assert last_params(srv).sampling.seed is None


def test_defaults_when_no_options_then_the_servers_sampling_defaults(live) -> None:
    srv = live(temperature=0.6, top_k=11)
    client(srv).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    s = last_params(srv).sampling
    assert (s.temperature, s.top_k) == (0.6, 11)


def test_truncate_when_false_then_a_prompt_over_the_context_is_refused(live) -> None:
    srv = live(context_length=64)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "word " * 40}],
        "options": {"num_predict": 2},
        "stream": False,
    }
    with srv.client() as c:
        refused = c.post("/api/chat", json={**body, "truncate": False})  # Ollama's field; its client lacks it
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]
        r = c.post("/api/chat", json=body)
        assert r.status_code == 200 and r.json()["done"]  # truncate (Ollama's default): a sliding window


def test_generate_when_system_then_chat_template_with_system_and_user(live) -> None:
    srv = live()
    r = client(srv).generate(model=MODEL, prompt="why?", system="be brief", stream=False)
    assert r.response == REPLY
    assert prompt_text(srv) == "<system>be brief\n<user>why?\n<assistant>"


def test_generate_when_raw_then_the_prompt_as_written(live) -> None:
    srv = live()
    client(srv).generate(model=MODEL, prompt="[INST] hi [/INST]", raw=True)
    assert prompt_text(srv) == "[INST] hi [/INST]"


def test_generate_when_streamed_then_response_parts(live) -> None:
    srv = live()
    parts = list(client(srv).generate(model=MODEL, prompt="hi", stream=True))
    assert "".join(p.response for p in parts) == REPLY and parts[-1].done_reason == "stop"


def test_logprobs_when_asked_then_one_per_token_with_alternatives(live) -> None:
    srv = live()
    r = client(srv).chat(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2
    )
    assert len(r.logprobs) == len(WORDS)
    first = r.logprobs[0]
    assert first.token == WORDS[0] and first.logprob == -0.1 and len(first.top_logprobs) == 2


def test_keep_alive_when_given_then_parsed_onto_the_job(live) -> None:
    srv = live()
    jobs = record_jobs(srv)
    c = client(srv)
    for keep_alive in ("5m", 30, -1, "0"):
        c.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], keep_alive=keep_alive)
    c.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert [j.request.keep_alive_s for j in jobs] == [300.0, 30.0, float("inf"), 0.0, None]


def test_load_request_when_no_messages_then_done_reason_load(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/api/chat", json={"model": MODEL, "messages": []})
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["done"] is True
        r = c.post("/api/generate", json={"model": MODEL})
        assert r.json()["done_reason"] == "load" and r.json()["response"] == ""
        assert [m["name"].split(":")[0] for m in c.get("/api/ps").json()["models"]] == [MODEL]
        # keep_alive 0 without a prompt unloads it (the worker does, as soon as no job uses the model)
        r = c.post("/api/generate", json={"model": MODEL, "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"
        deadline = time.monotonic() + 10
        while c.get("/api/ps").json()["models"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/api/ps").json()["models"] == []
    assert srv.engine.generations == []  # neither ran the model


# ---- errors -------------------------------------------------------------------------------------------


def test_unknown_model_when_chat_then_404_in_ollamas_words(live) -> None:
    srv = live()
    with pytest.raises(ollama.ResponseError) as err:
        client(srv).chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and err.value.error == "model 'nope' not found"


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}]}, 400, "model is required"),
        (
            "/api/chat",
            {"model": MODEL, "messages": [], "options": {"temperature": 5}},
            400,
            "options.temperature",
        ),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "messages[0].content",
        ),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ("/api/chat", {"model": MODEL, "format": "yaml", "messages": []}, 400, 'format must be "json"'),
        (
            "/api/generate",
            {"model": MODEL, "prompt": "x", "format": {"type": "array", "uniqueItems": True}},
            400,
            "format: unsupported or invalid",
        ),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "format": {"$ref": "#/nowhere"}},
            400,
            "format: unsupported or invalid",
        ),
        (
            "/api/chat",
            {"model": MODEL, "messages": [], "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
        (
            "/api/chat",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [OLLAMA_TOOL],
                "format": "json",
            },
            400,
            "format cannot be combined with tools",
        ),
        (
            "/api/chat",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            },
            400,
            "tools[0].function.parameters must describe an object",
        ),
        (
            "/api/chat",
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                ],
            },
            400,
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "images",
        ),
        ("/api/generate", {"model": MODEL, "prompt": "x", "images": ["aGk="]}, 400, "text only"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "context": [1, 2]}, 400, "context"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "raw": True, "system": "s"}, 400, "raw mode"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "think": True}, 400, "does not support thinking"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "keep_alive": True}, 400, "keep_alive"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"stop": [""]}}, 400, "options.stop[0]"),
        ("/api/show", {}, 400, "model is required"),
        ("/api/show", {"model": "nope"}, 404, "model 'nope' not found"),
        ("/api/embed", {"model": MODEL, "input": "x"}, 400, "it has no embeddings"),
        ("/api/embeddings", {"model": MODEL, "prompt": "x"}, 400, "it has no embeddings"),
        ("/api/embed", {"model": "nope", "input": "x"}, 404, "not found"),
    ],
)
def test_bad_request_when_sent_then_ollama_error_shape_and_status(live, path, body, status, words) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and words in error, error
    assert srv.engine.generations == []


def test_error_when_after_stream_started_then_an_error_line_ends_it(live) -> None:
    srv = live(fail_after_tokens=3, token_delay_s=0.01)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with srv.client() as c, c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        lines = ndjson(r)
    assert "".join(line["message"]["content"] for line in lines[:-1]) == " ".join(WORDS[:3])
    assert set(lines[-1]) == {"error"} and isinstance(lines[-1]["error"], str)
    with pytest.raises(ollama.ResponseError):  # Ollama's client raises it from the stream
        list(client(srv).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))


def test_route_header_when_upstream_under_policy_local_then_403_ollama_shaped(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post(
            "/api/chat",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Simmer-Route": "upstream"},
        )
    assert r.status_code == 403 and "SIMMER_ROUTE=local" in r.json()["error"]


# ---- models -------------------------------------------------------------------------------------------


def test_list_show_ps_version_when_asked_then_the_served_model(live) -> None:
    srv = live()
    c = client(srv)
    listed = c.list().models
    assert [m.model for m in listed] == [MODEL + ":latest"]
    assert listed[0].details.quantization_level == "q4"
    shown = c.show(MODEL)
    assert shown.capabilities == ["completion", "tools"]  # a chat model takes tools
    assert shown.modelinfo["unknown.context_length"] == 512  # the served context, from the engine
    assert "temperature 0.8" in shown.parameters
    running = c.ps().models
    assert [m.model for m in running] == [MODEL + ":latest"] and running[0].context_length == 512
    assert running[0].size_vram == 0
    with srv.client() as h:
        assert h.get("/api/version").json()["version"] == "0.12.0"
        assert h.head("/api/version").status_code == 200 and h.head("/api/tags").status_code == 200


def test_ps_when_keep_alive_expired_then_no_model_in_memory(live) -> None:
    import time

    srv = live(keep_alive_s=2.0)  # long enough that a loaded machine still sees it loaded first
    client(srv).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert client(srv).ps().models  # loaded; expires at keep_alive after the last request
    deadline = time.monotonic() + 20
    while client(srv).ps().models and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client(srv).ps().models == []


def test_root_when_asked_by_a_client_then_ollama_is_running_and_by_a_browser_the_page(live) -> None:
    srv = live()
    with srv.client() as c:
        assert c.get("/").text == "Ollama is running"  # curl and HTTP libraries send */*
        assert c.get("/", headers={"Accept": "application/json"}).text == "Ollama is running"
        head = c.head("/")
        assert head.status_code == 200 and head.text == ""
        page = c.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert page.headers["content-type"].startswith("text/html") and "<html" in page.text
        assert page.headers["vary"] == "Accept"


def test_governor_headers_when_a_governor_runs_then_on_every_api_response(live) -> None:
    from governor.governor import Governor

    gate = GovernorGate(Governor(usable_cpus=1, poll_s=0.05), pause_timeout_s=2.0)
    srv = live(governor=gate)
    with srv.client() as c:
        for method, path in (("GET", "/api/tags"), ("GET", "/v1/models"), ("POST", "/api/show")):
            r = c.request(method, path, json={"model": "nope"} if method == "POST" else None)
            assert r.headers["x-simmer-governor-level"] == "nominal", path
            assert r.headers["x-simmer-paused"] == "false", path
        assert "x-simmer-governor-level" not in c.get("/static/app.js").headers
    plain = live()
    with plain.client() as c:
        assert "x-simmer-governor-level" not in c.get("/api/tags").headers


# ---- pull and delete: a tiny real GGUF through the store ----------------------------------------------


def test_pull_when_local_gguf_then_progress_lines_then_listed_then_deleted(live, tiny_gguf, tmp_path) -> None:
    srv = live(pull_dirs=[tmp_path])
    gguf = tmp_path / "tiny-pull.gguf"
    shutil.copy(tiny_gguf, gguf)
    c = client(srv)
    parts = list(c.pull(str(gguf), stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    progress = [p for p in parts if p.total]
    assert progress and all(0 <= p.completed <= p.total == 1000 for p in progress)
    assert any(p.completed == p.total for p in progress)  # a stage reached its end
    names = [m.model for m in c.list().models]
    assert "tiny-pull:latest" in names
    shown = c.show("tiny-pull")
    assert shown.modelinfo["llama.block_count"] > 0 and "<|im_start|>" in shown.template
    assert c.pull(str(gguf), stream=False).status == "success"  # installed already: at once
    assert c.delete("tiny-pull").status == "success"
    assert "tiny-pull:latest" not in [m.model for m in c.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        c.delete("tiny-pull")
    assert err.value.status_code == 404


def test_pull_when_on_battery_then_it_waits_for_the_charger_holding_no_store_thread(
    live, tiny_gguf, tmp_path
) -> None:
    """A pull (its conversion and quality measurement) waits for the governor's leave: the stream says why,
    /v1/thermal lists it, nothing is installed, and the store's threads stay free (more waiting pulls than
    threads, and a delete still runs at once); the charger lets them finish."""
    battery = [BatteryReading(35.0, True)]
    gate = GovernorGate(Governor(usable_cpus=1, poll_s=0.05, read_battery=lambda: battery[0]))
    srv = live(pull_dirs=[tmp_path], governor=gate)
    ggufs = {}
    for name in ("tiny-keep", "tiny-wait", "tiny-wait-1", "tiny-wait-2", "tiny-wait-3"):
        ggufs[name] = tmp_path / f"{name}.gguf"
        shutil.copy(tiny_gguf, ggufs[name])
    assert client(srv).pull(str(ggufs["tiny-keep"]), stream=False).status == "success"  # plugged in: at once
    battery[0] = BatteryReading(35.0, False)
    time.sleep(0.3)  # the governor's next polls
    parts = client(srv).pull(str(ggufs["tiny-wait"]), stream=True)
    statuses = []
    for part in parts:
        statuses.append(part.status)
        if part.status.startswith("waiting"):
            break
    assert statuses[-1] == "waiting for the device: on battery at 35 % (below 50 %)", statuses
    for name in ("tiny-wait-1", "tiny-wait-2", "tiny-wait-3"):  # more than the store's two threads
        next(iter(client(srv).pull(str(ggufs[name]), stream=True)))
    time.sleep(0.3)
    thermal = httpx.get(srv.url + "/v1/thermal").json()["background_work"]
    assert thermal["runs"] is False and thermal["waiting"] == [
        "pull tiny-wait",
        "pull tiny-wait-1",
        "pull tiny-wait-2",
        "pull tiny-wait-3",
    ]
    assert "tiny-wait:latest" not in [m.model for m in client(srv).list().models]
    for i in range(4, 8):  # up to MAX_WAITING (8) wait; the ninth is refused at once
        ggufs[f"tiny-wait-{i}"] = tmp_path / f"tiny-wait-{i}.gguf"
        shutil.copy(tiny_gguf, ggufs[f"tiny-wait-{i}"])
        next(iter(client(srv).pull(str(ggufs[f"tiny-wait-{i}"]), stream=True)))
    time.sleep(0.3)
    ggufs["tiny-ninth"] = tmp_path / "tiny-ninth.gguf"
    shutil.copy(tiny_gguf, ggufs["tiny-ninth"])
    refused = httpx.post(srv.url + "/api/pull", json={"model": str(ggufs["tiny-ninth"])}, timeout=10)
    assert refused.status_code == 503 and "8 pulls already wait for the device" in refused.text
    # a model already installed answers at once, waiting for nothing
    assert client(srv).pull(str(ggufs["tiny-keep"]), stream=False).status == "success"
    t0 = time.monotonic()
    assert client(srv).delete("tiny-keep").status == "success"  # a store thread was free
    assert time.monotonic() - t0 < 5.0
    battery[0] = BatteryReading(35.0, True)
    rest = [part.status for part in parts]
    assert rest[-1] == "success" and not [s for s in rest if s.startswith("waiting")]
    assert "tiny-wait:latest" in [m.model for m in client(srv).list().models]
    deadline = time.monotonic() + 60
    while httpx.get(srv.url + "/v1/thermal").json()["background_work"]["waiting"]:
        assert time.monotonic() < deadline, "the other pulls did not run once plugged in"
        time.sleep(0.1)


def test_pull_when_unknown_name_then_404_before_any_stream(live) -> None:
    srv = live()
    with pytest.raises(ollama.ResponseError) as err:
        client(srv).pull("no-such-model", stream=True).__next__()
    assert err.value.status_code == 404


def test_pull_when_it_fails_midway_then_the_stream_ends_with_an_error_line(live, tmp_path: Path) -> None:
    srv = live(pull_dirs=[tmp_path / "pulls"])
    bad = tmp_path / "pulls" / "broken.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)  # a GGUF header and nothing behind it
    with srv.client() as c, c.stream("POST", "/api/pull", json={"model": str(bad)}) as r:
        assert r.status_code == 200
        lines = ndjson(r)
    assert lines[0] == {"status": "pulling manifest"}
    assert set(lines[-1]) == {"error"} and lines[-1]["error"]
    # nothing of it is left in the store: no model folder, no lock
    left = [p.relative_to(tmp_path / "models").as_posix() for p in (tmp_path / "models").rglob("*")]
    assert left in ([], [".locks"]), left


def test_pull_when_a_local_path_outside_pull_dirs_then_400_at_once_and_nothing_read_or_left(
    live, tmp_path: Path
) -> None:
    srv = live()  # no SIMMER_PULL_DIRS: no local path at all over HTTP
    secret = tmp_path / "secret.gguf"
    secret.write_text("GGUF-looking secret")
    with srv.client() as c:
        answers = [
            c.post("/api/pull", json={"model": name, "stream": True}) for name in (str(secret), "/nope.gguf")
        ]
    assert [r.status_code for r in answers] == [400, 400]
    messages = [r.json()["error"] for r in answers]
    assert messages[0].replace(str(secret), "X") == messages[1].replace("/nope.gguf", "X")
    assert "SIMMER_PULL_DIRS" in messages[0] and "secret" not in messages[0].replace(str(secret), "")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_delete_when_the_served_model_then_refused(live) -> None:
    srv = live()
    with pytest.raises(ollama.ResponseError) as err:
        client(srv).delete(MODEL)
    assert err.value.status_code == 400 and "SIMMER_MODEL" in err.value.error


def test_pull_when_many_wait_on_a_held_model_lock_then_other_routes_still_answer_at_once(
    live, tmp_path: Path
) -> None:
    """A `simmer pull --force` holds the model's lock; 40 pulls of that model wait for it (more than asyncio's
    default pool has threads, on any machine). /api/tags, /v1/models and /tokenize, which use a thread for
    their reading, must still answer at once; once the lock is let go, every pull ends."""
    from concurrent.futures import ThreadPoolExecutor

    import models.convert.pipeline  # noqa: F401  (imported by the first pull: its seconds of GIL are not this)
    from models.store import filelock

    srv = live(hf_offline=True)  # the pulls end at once (offline, nothing cached) when they get the lock
    lock = tmp_path / "models" / ".locks" / "model.lock"
    with ThreadPoolExecutor(40) as pool, filelock.held(lock):
        body = {"model": "hf:owner/repo/model.gguf", "stream": False}
        pulls = [pool.submit(httpx.post, srv.url + "/api/pull", json=body, timeout=60) for _ in range(40)]
        time.sleep(1.0)  # every pull is in, waiting for the lock
        assert not any(p.done() for p in pulls)
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for method, path, json_body in (
                ("GET", "/api/tags", None),
                ("GET", "/v1/models", None),
                ("POST", "/tokenize", {"content": "hello"}),
            ):
                started = time.monotonic()
                assert c.request(method, path, json=json_body).status_code == 200, path
                assert time.monotonic() - started < 2, path
    answers = [p.result(timeout=60) for p in pulls]
    assert {r.status_code for r in answers} == {502}, {r.text for r in answers}
    assert all("offline" in r.json()["error"] for r in answers)
