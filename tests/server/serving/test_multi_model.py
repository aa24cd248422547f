"""Several models behind one server (tiny real ones, converted folders): /v1/models, `model` picks one,
keep_alive per request, the memory planner's 503, chat requests skipping a base model's rung, and a reply
moved to another model mid-way over HTTP (same tokenizer and another one) with continuous text."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest

from models.protocol import EngineLimits, Prompt
from models.runtime.engine import load_engine
from models.types import CancelToken, GenerationParams, SamplingParams, TokenEvent
from server.serving.contracts import NoGate
from server.serving.memory_plan import MemoryBudget
from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings, responses_events, wait_ready
from tests.server.serving.helpers import PROMPT, reference, stream

MiB = 1 << 20


def models(srv) -> dict[str, dict]:
    body = httpx.get(srv.url + "/v1/models").json()
    return {m["id"]: m for m in body["data"]}


def cost_nominal(served, model: str):
    """What the model costs loaded as it opens: on its nominal variant (the conversion's choice)."""
    entry = served.catalog.get(model)
    return served.cost(entry, entry.default_variant)


def complete(srv, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=30)


def test_models_when_several_installed_then_each_listed_with_its_facts(several, tiny_pair_dirs):
    srv, served = several()
    listed = models(srv)
    assert set(listed) == {"tiny-big", "tiny-small", "tiny-spm", "tiny-base"}
    assert next(iter(listed)) == "tiny-small"  # the default first
    small, base = listed["tiny-small"], listed["tiny-base"]
    manifest = json.loads((tiny_pair_dirs[1] / "manifest.json").read_text())
    assert small["default"] is True and listed["tiny-big"]["default"] is False
    assert small["variants"][0] in manifest["variants"] and set(small["variants"]) == set(
        manifest["variants"]
    )
    assert small["variant"] == manifest["default_variant"]  # the nominal variant, chosen at conversion
    assert small["context_length"] == 128 and small["max_context_length"] == manifest["context_length"]
    assert small["disk_bytes"] == sum(p.stat().st_size for p in tiny_pair_dirs[1].iterdir() if p.is_file())
    assert (small["can_chat"], base["can_chat"]) == (True, False)
    assert small["loaded"] is True and listed["tiny-big"]["loaded"] is False  # the default loads at start
    cost = cost_nominal(served, "tiny-big").total
    assert listed["tiny-big"]["resident_bytes_estimate"] == cost and cost > 128 * MiB  # runtime included
    # every variant's quality and speed as measured at pull time
    for name, entry in manifest["variants"].items():
        shown = small["variant_quality"][name]
        assert (
            shown["kl_mean"] == entry["quality"]["kl_mean"] and shown["kl_p99"] == entry["quality"]["kl_p99"]
        )
        assert shown["top1_agreement"] == entry["quality"]["top1_agreement"]
        assert shown["decode_tok_s"] == entry["speed"]["decode_tok_s"] and shown["tokens_per_cpu_s"] > 0


def test_request_model_when_named_then_that_model_serves_and_unknown_is_404(several):
    srv, _ = several()
    for model in ("tiny-big", "tiny-spm", "tiny-small", None):
        r = complete(srv, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == (model or "tiny-small")
    assert {m for m, e in models(srv).items() if e["loaded"]} == {"tiny-big", "tiny-spm", "tiny-small"}
    missing = complete(srv, "tiny-huge")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "'tiny-huge'" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("keep_alive", "loaded", "expires"),
    [(0, False, None), ("5m", True, 300.0), (-1, True, None), ("90s", True, 90.0)],
)
def test_keep_alive_when_given_per_request_then_ollama_semantics(several, keep_alive, loaded, expires):
    srv, _ = several()
    assert complete(srv, "tiny-big", keep_alive=keep_alive).status_code == 200
    entry = models(srv)["tiny-big"]
    assert entry["loaded"] is loaded
    if expires is None:
        assert entry["keep_alive_s"] is None
    else:
        assert expires - 5 <= entry["keep_alive_s"] <= expires


def test_keep_alive_when_not_a_duration_then_400(several):
    srv, _ = several()
    r = complete(srv, "tiny-big", keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_keep_alive_default_when_idle_past_it_then_unloaded_by_the_worker(several):
    srv, _ = several(keep_alive_s=0.3)
    assert complete(srv, "tiny-big").status_code == 200
    deadline = time.monotonic() + 5
    while models(srv)["tiny-big"]["loaded"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not models(srv)["tiny-big"]["loaded"]


def test_memory_when_a_model_does_not_fit_then_503_with_numbers_and_nothing_unloaded(several):
    srv, served = several()
    small = cost_nominal(served, "tiny-small").total
    big = cost_nominal(served, "tiny-big").with_rows(1).total  # one reply at a time: its least
    assert small < big
    served.pool.budget = MemoryBudget((small + big) // 2, 0)  # the default fits; the big one alone does not
    r = complete(srv, "tiny-big")
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory" and "Nothing was unloaded" in error["message"]
    assert error["memory"]["needed_bytes"] == big and error["memory"]["idle_bytes"] == small
    assert models(srv)["tiny-small"]["loaded"] and complete(srv, "tiny-small").status_code == 200
    assert served.pool.rows_cap is None  # a refusal gives up nothing, batch rows neither


def test_memory_when_fewer_batch_rows_make_room_then_both_loaded_and_batches_of_fewer_replies(several):
    """SIMMER_MAX_BATCH 4: each model budgets four KV rows of the whole context. Two rows each fit beside
    each other, four do not: the load lowers the rows (every model's) rather than unload the idle one."""
    srv, served = several()
    small, big = cost_nominal(served, "tiny-small"), cost_nominal(served, "tiny-big")
    assert small.rows == big.rows == 4
    served.pool.budget = MemoryBudget(small.with_rows(2).total + big.with_rows(2).total, 0)
    assert complete(srv, "tiny-big").status_code == 200
    assert {m for m, e in models(srv).items() if e["loaded"]} == {"tiny-small", "tiny-big"}
    assert served.pool.rows_cap == 2
    assert srv.app.state.runtime.worker.placement.rows() == 2


def test_memory_when_two_do_not_fit_together_then_the_idle_one_unloaded(several):
    srv, served = several()
    small = cost_nominal(served, "tiny-small").total
    big = cost_nominal(served, "tiny-big").total
    served.pool.budget = MemoryBudget(big + small // 2, 0)
    assert complete(srv, "tiny-big").status_code == 200
    loaded = {m for m, e in models(srv).items() if e["loaded"]}
    assert loaded == {"tiny-big"}


def test_ladder_when_chat_request_then_skips_the_rung_that_cannot_chat(several):
    srv, _ = several(ladder="tiny-base,tiny-small", model="tiny-base")
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "tiny-small" and chat.json()["usage"]["models"] == {"tiny-small": 3}
    text = complete(srv, "tiny-base")
    assert text.json()["model"] == "tiny-base"
    # without a chat rung below it, the base model refuses chat at once
    alone = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "tiny-spm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert alone.status_code == 200  # tiny-spm chats (its own template)


def test_ladder_when_base_model_not_on_a_ladder_then_chat_refused_at_once(several):
    srv, _ = several()
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_chat"


# -- a reply moved to another model mid-way ----------------------------------------------------------------
class SwitchingGate:
    """A gate through the real seam: after `after` steps the governor's rung is `target`'s."""

    memory_pressure = False
    pauses_new = False
    background = NoGate.background

    def __init__(self, target: str, after: int) -> None:
        self.target = target
        self.after = after
        self.steps = 0
        self.rung: str | None = None  # the governor's rung: the target's once it moved

    def subscribe(self, callback) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        self.steps += 1
        if self.steps == self.after:
            self.rung = self.target
            return EngineLimits(model_id=self.target, variant="f32")
        return None

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        return None


@pytest.mark.parametrize("second", ["tiny-small", "tiny-spm"])
def test_switch_when_governor_moves_the_rung_mid_reply_then_model_field_changes_and_text_continues(
    several, tiny_pair_dirs, tiny_spm_dir, second
):
    gate = SwitchingGate(second, after=8)
    srv, _ = several(governor=gate, ladder=f"tiny-big:f32,{second}:f32", model="tiny-big")
    text, names, switches, usage = stream(srv, "tiny-big", 24)

    assert names[0] == "tiny-big" and names[-1] == second
    assert names == sorted(names, key=lambda n: n != "tiny-big")  # one change, never back
    assert (
        len(switches) == 1 and switches[0]["old"] == "tiny-big/f32" and switches[0]["new"] == f"{second}/f32"
    )
    n_first = usage["models"]["tiny-big"]
    assert usage["models"] == {"tiny-big": n_first, second: 24 - n_first} and 0 < n_first < 24
    assert switches[0]["tokens_before"] == n_first
    second_dir = tiny_pair_dirs[1] if second == "tiny-small" else tiny_spm_dir
    assert text == reference(
        tiny_pair_dirs[0], second_dir, n_first, 24, same_tokenizer=second == "tiny-small"
    )


class SteppingGate(SwitchingGate):
    """The governor's rung steps down a ladder mid-reply: to `schedule[step]` at each of those steps."""

    def __init__(self, schedule: dict[int, str]) -> None:
        super().__init__(next(iter(schedule.values())), after=10**9)
        self.schedule = schedule

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        self.steps += 1
        target = self.schedule.get(self.steps)
        if target is None:
            return None
        self.rung = target
        return EngineLimits(model_id=target, variant="f32")


def test_switch_when_a_three_size_ladder_steps_down_twice_mid_reply_then_no_text_lost_or_repeated(
    several, tiny_pair_dirs, tiny_spm_dir
):
    """The phone ladder's shape (qwen2.5-coder-1.5b, -0.5b, smollm2): two sizes of one tokenizer (the KV
    rebuilt once from the same ids), then a model of another vocabulary (the text re-tokenized)."""
    gate = SteppingGate({6: "tiny-small", 14: "tiny-spm"})
    ladder = "tiny-big:f32,tiny-small:f32,tiny-spm:f32"
    srv, _ = several(governor=gate, ladder=ladder, model="tiny-big")
    text, names, switches, usage = stream(srv, "tiny-big", 24)

    assert [(s["old"], s["new"]) for s in switches] == [
        ("tiny-big/f32", "tiny-small/f32"),
        ("tiny-small/f32", "tiny-spm/f32"),
    ]
    assert list(dict.fromkeys(names)) == ["tiny-big", "tiny-small", "tiny-spm"]  # in order, never back
    n_big, n_small = usage["models"]["tiny-big"], usage["models"]["tiny-small"]
    assert usage["models"] == {"tiny-big": n_big, "tiny-small": n_small, "tiny-spm": 24 - n_big - n_small}
    assert [s["tokens_before"] for s in switches] == [n_big, n_big + n_small]

    # the same greedy reply, model by model, engines alone: big, then small on the same ids, then spm
    # from the text so far
    big, small = (load_engine(d, variant="f32", threads=1, context_length=128) for d in tiny_pair_dirs)
    spm = load_engine(tiny_spm_dir, variant="f32", threads=1, context_length=128)
    prompt = big.text_prompt(PROMPT)
    greedy = GenerationParams(SamplingParams(temperature=0), max_tokens=n_big, ignore_eos=True)
    first = [e for e in big.generate(prompt, greedy) if isinstance(e, TokenEvent)]
    then = Prompt(prompt.ids + [e.token_id for e in first])
    second = [
        e for e in small.generate(then, replace(greedy, max_tokens=n_small)) if isinstance(e, TokenEvent)
    ]
    shown = "".join(e.text for e in first + second)
    rest = list(
        spm.generate(spm.continuation_prompt(PROMPT, shown), replace(greedy, max_tokens=24 - n_big - n_small))
    )
    assert text == shown + "".join(e.text for e in rest)


class PressedGate(SwitchingGate):
    """The governing level comes from memory (the gate's memory_pressure)."""

    memory_pressure = True


@pytest.mark.parametrize("pressed", [False, True])
def test_switch_when_memory_pressure_moves_the_reply_then_the_bigger_model_unloaded(
    several, tiny_pair_dirs, pressed
):
    gate = (PressedGate if pressed else SwitchingGate)("tiny-small", after=8)
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    _, names, switches, _ = stream(srv, "tiny-big", 16)
    assert names[0] == "tiny-big" and names[-1] == "tiny-small" and len(switches) == 1
    loaded = {m for m, e in models(srv).items() if e["loaded"]}
    # keep_alive is forever here, yet the model the reply left is above the governor's rung and idle: it goes
    assert loaded == {"tiny-small"}


@pytest.mark.parametrize("pressed", [False, True])
def test_request_when_memory_pressure_then_fewer_batch_rows_first_then_only_the_serving_model_stays(
    several, pressed
):
    """Under memory pressure each batch's start first halves the replies a batch may hold (SIMMER_MAX_BATCH
    4: 2, then one at a time), and only then unloads the models that do not serve."""
    gate = (PressedGate if pressed else SwitchingGate)("tiny-small", after=10**9)  # never moves the rung
    srv, served = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    assert {m for m, e in models(srv).items() if e["loaded"]} == {"tiny-big"}  # loaded at start
    seen = []
    for _ in range(3):
        assert complete(srv, "tiny-small").status_code == 200
        seen.append((served.pool.rows_cap, {m for m, e in models(srv).items() if e["loaded"]}))
    both = {"tiny-big", "tiny-small"}
    if pressed:
        assert seen == [(2, both), (1, both), (1, {"tiny-small"})]
    else:
        assert seen == [(None, both)] * 3


# -- an idle bigger model once the governor's rung moved below it ------------------------------------------
class RungGate(SwitchingGate):
    """The governor's rung moves while no request runs: `move(model)` sets it and publishes the change,
    as the real gate's subscription does."""

    def __init__(self) -> None:
        super().__init__("tiny-small", after=10**9)
        self.publish = None

    def subscribe(self, callback) -> None:
        self.publish = callback

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None if self.rung is None else EngineLimits(model_id=self.rung, variant="f32")

    def move(self, model: str) -> None:
        self.rung = model
        assert self.publish is not None
        self.publish({"limits": {"model_id": model}})


def loaded_now(srv) -> set[str]:
    return {m for m, e in models(srv).items() if e["loaded"]}


def wait_loaded(srv, expected: set[str]) -> None:
    for _ in range(250):
        if loaded_now(srv) == expected:
            return
        time.sleep(0.02)
    assert loaded_now(srv) == expected


def test_rung_when_it_moves_below_an_idle_bigger_model_then_the_worker_unloads_it_without_a_request(several):
    gate = RungGate()
    srv, served = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    assert complete(srv, "tiny-small").status_code == 200  # both loaded, kept (keep_alive forever)
    assert loaded_now(srv) == {"tiny-big", "tiny-small"}
    before = {m: v.bytes for m, v in served.pool.loaded().items()}

    gate.move("tiny-small")
    wait_loaded(srv, {"tiny-small"})
    after = {m: v.bytes for m, v in served.pool.loaded().items()}
    assert sum(after.values()) == sum(before.values()) - before["tiny-big"] and before["tiny-big"] > 0
    for _ in range(250):  # the view drops it first; the count after its engine let go of its memory
        if served.pool.unloads:
            break
        time.sleep(0.02)
    assert served.pool.unloads == 1

    # a request naming the bigger model is placed on the rung: it does not bring the bigger one back
    assert complete(srv, "tiny-big").json()["model"] == "tiny-small"
    assert loaded_now(srv) == {"tiny-small"}
    # the rung back up unloads nothing below it; the bigger model loads when a request needs it
    gate.move("tiny-big")
    assert complete(srv, "tiny-big").json()["model"] == "tiny-big"
    assert loaded_now(srv) == {"tiny-big", "tiny-small"} and served.pool.unloads == 1


def test_rung_when_it_moves_below_an_idle_bigger_model_with_memory_to_spare_then_it_stays_for_a_swap_back(
    several,
):
    """Memory to spare (the budget keeps the start's headroom with both models in it): the idle bigger model
    stays loaded when the rung moves below it, so the step back up is a swap, not a load."""
    gate = RungGate()
    ladder = "tiny-big:f32,tiny-small:f32"
    srv, served = several(
        governor=gate, ladder=ladder, model="tiny-big", keep_warm=True, memory_budget_mb=4096
    )
    assert complete(srv, "tiny-small").status_code == 200
    assert loaded_now(srv) == {"tiny-big", "tiny-small"}
    loads = served.pool.loads
    gate.move("tiny-small")
    assert complete(srv, "tiny-big").json()["model"] == "tiny-small"  # placed on the rung
    time.sleep(0.2)  # the worker looked at the rung (it did for the request above too)
    assert loaded_now(srv) == {"tiny-big", "tiny-small"} and served.pool.unloads == 0
    gate.move("tiny-big")
    assert complete(srv, "tiny-big").json()["model"] == "tiny-big"
    assert served.pool.loads == loads  # a swap: nothing loaded again


def test_rung_when_it_moves_below_an_idle_bigger_model_without_memory_to_spare_then_it_goes(several) -> None:
    """The same with a budget that both models fill to within the headroom: the bigger one is unloaded."""
    gate = RungGate()
    probe, served = several(ladder="tiny-big:f32,tiny-small:f32", model="tiny-big", keep_warm=True)
    both = sum(served.cost(served.catalog.get(m), "f32").total for m in ("tiny-big", "tiny-small"))
    probe.stop()
    budget_mb = both // MiB + 8  # both fit, with 8 MiB left: less than any headroom
    srv, served = several(
        governor=gate,
        ladder="tiny-big:f32,tiny-small:f32",
        model="tiny-big",
        keep_warm=True,
        memory_budget_mb=budget_mb,
    )
    assert complete(srv, "tiny-small").status_code == 200
    assert loaded_now(srv) == {"tiny-big", "tiny-small"}
    gate.move("tiny-small")
    wait_loaded(srv, {"tiny-small"})


def test_start_when_the_governor_is_already_on_a_lower_rung_then_only_that_model_loads(several):
    """The governor's first reading comes before the worker's first load: where it already put the ladder
    on a cheaper rung (a hot device), the memory tier's bigger pick is not loaded only to be left."""
    gate = RungGate()
    gate.rung = "tiny-small"
    srv, served = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    assert loaded_now(srv) == {"tiny-small"} and served.pool.unloads == 0
    assert complete(srv, None).json()["model"] == "tiny-small"
    gate.move("tiny-big")  # cooled: the bigger model loads for the next request
    assert complete(srv, None).json()["model"] == "tiny-big"


def test_rung_when_only_the_bigger_model_can_serve_then_it_loads_for_the_request(several):
    """A chat request skips the base rung below: the chat model above it serves, although the rung is lower,
    and it is unloaded once idle again (the device is hot or short of memory)."""
    gate = RungGate()
    srv, _ = several(governor=gate, ladder="tiny-small:f32,tiny-base:f32", model="tiny-small")
    gate.move("tiny-base")
    wait_loaded(srv, set())  # the preloaded chat model is above the rung
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "tiny-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["model"] == "tiny-small"
    wait_loaded(srv, set())


def test_switch_when_the_bigger_model_is_unloaded_mid_reply_then_its_sessions_are_freed_at_once(several):
    """Neither the reply's finished generation on the bigger model nor its cancel token may keep that model's
    onnxruntime sessions alive past the unload (their memory would come back only after the reply)."""
    import weakref

    gate = SwitchingGate("tiny-small", after=8)
    srv, served = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    alive_after_unload: list[bool] = []
    unload = served.pool.unload

    def watched(model_id: str, reason: str) -> bool:
        engine = served.pool.engine(model_id)
        refs = [weakref.ref(s) for s in engine._sessions.values()] if engine is not None else []
        done = unload(model_id, reason)
        alive_after_unload.extend(ref() is not None for ref in refs)
        return done

    served.pool.unload = watched
    _, names, switches, _ = stream(srv, "tiny-big", 16)
    assert names[-1] == "tiny-small" and len(switches) == 1
    assert alive_after_unload and not any(alive_after_unload)


# -- Ollama's NDJSON: each line names the model that produced it ------------------------------------------
def ollama_stream(srv, body: dict) -> list[dict]:
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("second", ["tiny-small", "tiny-spm"])
def test_switch_when_ollama_streams_then_lines_name_their_model_and_the_last_counts_tokens_per_model(
    several, tiny_pair_dirs, tiny_spm_dir, second
):
    gate = SwitchingGate(second, after=8)
    srv, _ = several(governor=gate, ladder=f"tiny-big:f32,{second}:f32", model="tiny-big")
    options = {"num_predict": 24, "temperature": 0}
    lines = ollama_stream(srv, {"model": "tiny-big", "prompt": PROMPT, "raw": True, "options": options})

    *pieces, last = lines
    names = [line["model"] for line in pieces]
    assert names[0] == "tiny-big" and names[-1] == second
    assert names == sorted(names, key=lambda n: n != "tiny-big")  # one change, never back
    assert last["done"] is True and last["model"] == second and last["eval_count"] == 24
    n_first = last["eval_count_by_model"]["tiny-big"]
    assert last["eval_count_by_model"] == {"tiny-big": n_first, second: 24 - n_first} and 0 < n_first < 24
    text = "".join(line["response"] for line in lines)
    second_dir = tiny_pair_dirs[1] if second == "tiny-small" else tiny_spm_dir
    assert text == reference(
        tiny_pair_dirs[0], second_dir, n_first, 24, same_tokenizer=second == "tiny-small"
    )


def test_rung_when_a_request_is_placed_on_another_model_then_ollama_names_it_in_the_clients_style(several):
    """The official client: the reply the governor placed on the smaller model names it, with the default
    tag as the client wrote its own model's name; a model the reply stayed on is echoed as sent."""
    import ollama

    gate = RungGate()
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    client = ollama.Client(host=srv.url, timeout=30)
    messages = [{"role": "user", "content": "hi"}]
    options = {"num_predict": 3, "temperature": 0}
    chunks = list(client.chat(model="tiny-big:latest", messages=messages, options=options, stream=True))
    assert {c.model for c in chunks} == {"tiny-big:latest"}
    gate.move("tiny-small")
    chunks = list(client.chat(model="tiny-big:latest", messages=messages, options=options, stream=True))
    assert {c.model for c in chunks} == {"tiny-small:latest"} and chunks[-1].done
    whole = client.chat(model="tiny-big", messages=messages, options=options)  # not streamed
    assert whole.model == "tiny-small"


# -- OpenAI's Responses API: the response names the model producing it, usage counts per model ------------
def responses_sdk(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


class AgainGate(SwitchingGate):
    """`again()`: the governor's rung back on `first` for the next job, and the switch at the same step."""

    def __init__(self, target: str, after: int, first: str = "tiny-big") -> None:
        super().__init__(target, after)
        self.first = first
        self.back: EngineLimits | None = None

    def again(self) -> None:
        self.steps, self.rung = 0, self.first
        self.back = EngineLimits(model_id=self.first, variant="f32")

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        back, self.back = self.back, None
        return back


def chat_reference(srv, gate: AgainGate, max_tokens: int) -> dict:
    """The same request as a chat completion on the same server, the gate's switch at the same step (the
    OpenAI dialect's switch is checked against the engines alone above); then the rung back up."""
    body = {
        "model": "tiny-big",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    gate.again()
    return r.json()


@pytest.mark.parametrize("second", ["tiny-small", "tiny-spm"])
def test_switch_when_responses_streams_then_events_name_the_current_model_and_usage_counts_per_model(
    several, second
):
    gate = AgainGate(second, after=8)
    srv, _ = several(governor=gate, ladder=f"tiny-big:f32,{second}:f32", model="tiny-big")
    chat = chat_reference(srv, gate, 24)
    events = list(
        responses_sdk(srv).responses.create(
            model="tiny-big", input=PROMPT, max_output_tokens=24, temperature=0, stream=True
        )
    )

    lifecycle = [(e.type, e.response.model) for e in events if hasattr(e, "response")]
    assert lifecycle[:2] == [("response.created", "tiny-big"), ("response.in_progress", "tiny-big")]
    assert lifecycle[2:] == [("response.in_progress", second), (events[-1].type, second)]
    moved = next(i for i, e in enumerate(events) if e.type == "response.in_progress" and i > 1)
    switch = events[moved].switch  # simmer's, as chat's `event: governor` has it
    assert (switch["old"], switch["new"]) == ("tiny-big/f32", f"{second}/f32") and switch["reason"]
    final = events[-1].response
    n_first = final.usage.models["tiny-big"]
    assert switch["tokens_before"] == n_first and 0 < n_first < final.usage.output_tokens
    assert final.usage.models == {"tiny-big": n_first, second: final.usage.output_tokens - n_first}
    assert final.usage.models == chat["usage"]["models"] and chat["model"] == second
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    before = "".join(e.delta for e in events[:moved] if e.type == "response.output_text.delta")
    assert before and "".join(deltas) == final.output_text == chat["choices"][0]["message"]["content"]
    in_progress = events[moved].response.output[0]  # the output as it stood at the switch
    assert in_progress.status == "in_progress" and in_progress.content[0].text == before


def test_switch_when_responses_streams_with_governor_events_then_chat_s_switch_event_too(several):
    gate = SwitchingGate("tiny-small", after=8)
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    body = {"model": "tiny-big", "input": PROMPT, "max_output_tokens": 24, "governor_events": True}
    events = responses_events(srv, body)
    at = next(i for i, (name, _) in enumerate(events) if name == "governor")
    moved = events[at - 1][1]  # right after the response.in_progress naming the new model
    assert moved["type"] == "response.in_progress" and moved["response"]["model"] == "tiny-small"
    assert events[at][1] == {"switch": moved["switch"]}  # chat's `event: governor` at a switch
    assert [name for name, _ in events].count("governor") == 1


def test_switch_when_responses_not_streamed_or_sdk_helper_then_the_model_that_finished_and_its_usage(several):
    gate = AgainGate("tiny-spm", after=8)
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-spm:f32", model="tiny-big")
    chat = chat_reference(srv, gate, 24)
    sdk = responses_sdk(srv)
    r = sdk.responses.create(model="tiny-big", input=PROMPT, max_output_tokens=24, temperature=0)
    assert r.model == "tiny-spm" and r.usage.models == chat["usage"]["models"]
    n_first = r.usage.models["tiny-big"]
    assert r.usage.models == {"tiny-big": n_first, "tiny-spm": r.usage.output_tokens - n_first}
    assert 0 < n_first < r.usage.output_tokens
    assert r.output_text == chat["choices"][0]["message"]["content"]
    gate.again()  # the SDK's stream helper takes the response.in_progress at the switch in its stride
    with sdk.responses.stream(model="tiny-big", input=PROMPT, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)  # 24 tokens: response.incomplete, which get_final_response() does not take
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == r.output_text and final.model == "tiny-spm"
    assert final.usage.models == r.usage.models


def test_rung_when_a_responses_request_is_placed_on_another_model_then_every_response_names_it(several):
    gate = RungGate()
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-small:f32", model="tiny-big")
    gate.move("tiny-small")
    client = responses_sdk(srv)
    events = list(client.responses.create(model="tiny-big", input="hi", max_output_tokens=3, stream=True))
    models_named = [(e.type, e.response.model) for e in events if hasattr(e, "response")]
    assert models_named == [
        ("response.created", "tiny-small"),
        ("response.in_progress", "tiny-small"),
        (events[-1].type, "tiny-small"),
    ]
    assert events[-1].response.usage.models == {"tiny-small": 3}
    whole = client.responses.create(model="tiny-big", input="hi", max_output_tokens=3)
    assert whole.model == "tiny-small" and whole.usage.models == {"tiny-small": 3}


class SlowAfterSwitchGate(SwitchingGate):
    """The switch, then every step slow: a reply long enough to leave in the middle of."""

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        if self.rung is not None:
            time.sleep(0.02)
        return super().before_step(cancel)


def test_switch_when_a_responses_client_leaves_at_the_switch_then_the_worker_stops_and_serves_the_next(
    several,
):
    gate = SlowAfterSwitchGate("tiny-spm", after=8)
    srv, _ = several(governor=gate, ladder="tiny-big:f32,tiny-spm:f32", model="tiny-big", context_length=256)
    worker = srv.app.state.runtime.worker
    body = {"model": "tiny-big", "input": PROMPT, "max_output_tokens": 150, "temperature": 0, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # leave at the switch, before the new model's first text
                if line.startswith("data: ") and '"switch"' in line:
                    assert json.loads(line.removeprefix("data: "))["response"]["model"] == "tiny-spm"
                    break
            else:
                raise AssertionError("no switch in the stream")
        deadline = time.monotonic() + 10
        while worker.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not worker.busy
        steps = gate.steps
        time.sleep(0.2)
        assert gate.steps == steps < 8 + 150 - 20  # the reply stopped, long before its 150 tokens
        after = c.post("/v1/responses", json={**body, "stream": False, "max_output_tokens": 3})
    assert after.status_code == 200, after.text
    reply = after.json()
    assert reply["status"] == "incomplete" and reply["usage"]["output_tokens"] == 3
    assert reply["model"] == "tiny-spm"  # the governor's rung stays on the smaller model


class SlowRungGate(RungGate):
    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        time.sleep(0.02)
        return super().before_step(cancel)


def test_rung_when_a_responses_stream_opened_while_queued_then_the_model_named_once_it_starts(several):
    """The stream opens before the worker starts the job (queued past the ping interval): the response
    named the model asked for; a response.in_progress names the rung's once the job starts there."""
    import threading

    gate = SlowRungGate()
    # one reply at a time: with batch rows free (as the memory plan allows in a small process) the
    # response joins the running batch at once instead of waiting
    srv, _ = several(
        governor=gate,
        ladder="tiny-big:f32,tiny-small:f32",
        model="tiny-big",
        keepalive_ping_s=0.05,
        max_batch=1,
    )
    gate.move("tiny-small")
    sdk = responses_sdk(srv)
    long = {"model": "tiny-small", "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}  # 0.8 s at least
    ahead = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",), kwargs={"json": long})
    ahead.start()
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 10
    while not worker.busy and time.monotonic() < deadline:
        time.sleep(0.005)
    events = list(sdk.responses.create(model="tiny-big", input="hi", max_output_tokens=3, stream=True))
    ahead.join(30)
    named = [(e.type, e.response.model) for e in events if hasattr(e, "response")]
    assert named == [
        ("response.created", "tiny-big"),
        ("response.in_progress", "tiny-big"),
        ("response.in_progress", "tiny-small"),
        (events[-1].type, "tiny-small"),
    ]
    assert not hasattr(events[2], "switch") or events[2].switch is None  # placed, not moved mid-reply


class PacedGate(SwitchingGate):
    """The governor paces on one quiet thread from the first job on."""

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return EngineLimits(threads=1, spin=False)  # what the engine hears of a pace: no spinning


def test_load_when_the_governor_paces_then_one_session_built_for_its_threads_and_spinning(several, caplog):
    """A model loaded for a job opens with the governor's limits: its one session is the one that runs (a
    load used to build a spinning session at the configured threads, then the job's own: twice the CPU
    of a session build, heat on a device the governor is holding at its envelope)."""
    srv, served = several(governor=PacedGate("tiny-small", after=10**9), model="tiny-big", threads=2)
    caplog.set_level("INFO", logger="simmer.engine")
    assert complete(srv, "tiny-small").status_code == 200
    engine = served.pool._loaded["tiny-small"].engine
    assert list(engine._sessions) == [(engine.variant, 1, False)]
    builds = [
        r
        for r in caplog.records
        if r.name == "simmer.engine" and r.getMessage().startswith("loaded tiny-small/")
    ]
    assert len(builds) == 1 and "with 1 threads" in builds[0].getMessage()


# -- every route answers with the model it names, whatever ran last ----------------------------------------
def tokenizer_answers(srv, model: str | None) -> dict[str, object]:
    named = {} if model is None else {"model": model}
    messages = [{"role": "user", "content": PROMPT}]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        ids = c.post("/tokenize", json={"content": PROMPT, **named}).json()["tokens"]
        return {
            "tokenize": ids,
            "detokenize": c.post("/detokenize", json={"tokens": ids[:3], **named}).json()["content"],
            "apply-template": c.post("/apply-template", json={"messages": messages, **named}).json()[
                "prompt"
            ],
        }


def test_tokenizer_routes_when_another_model_ran_last_then_the_named_model_answers(several, tiny_pair_dirs):
    srv, _ = several()
    small = tokenizer_answers(srv, "tiny-small")
    spm = tokenizer_answers(srv, "tiny-spm")
    assert spm["tokenize"] != small["tokenize"] and spm["apply-template"] != small["apply-template"]
    assert complete(srv, "tiny-spm").status_code == 200  # tiny-spm is now the engine that ran last
    assert tokenizer_answers(srv, "tiny-small") == small
    # no model named: the default model (tiny-small), as a generation request without one
    assert tokenizer_answers(srv, None) == small
    # a model never loaded answers with its own tokenizer
    big = load_engine(tiny_pair_dirs[0], variant="q4", threads=1, context_length=128)
    assert tokenizer_answers(srv, "tiny-big")["tokenize"] == big.tokenize(PROMPT, add_special=False)


def ollama_generate(srv, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "stream": False, "options": {"num_predict": 2}}
    return httpx.post(srv.url + "/api/generate", json=body, timeout=30)


def test_ollama_generate_when_the_other_kind_of_model_ran_last_then_the_named_model_decides(
    several, tiny_pair_dirs
):
    srv, _ = several()  # tiny-small, a chat model, is loaded at start
    base = ollama_generate(srv, "tiny-base", "Once upon a time")
    assert base.status_code == 200, base.text  # a base model continues the text
    small = load_engine(tiny_pair_dirs[1], variant="q4", threads=1, context_length=128)
    prompt = "A fresh prompt about the sea"
    as_chat = len(small.chat_prompt([{"role": "user", "content": prompt}]).ids)
    assert as_chat != len(small.text_prompt(prompt).ids)
    r = ollama_generate(srv, "tiny-small", prompt)  # tiny-base ran last
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] == as_chat


def test_rung_when_the_device_is_past_its_throttling_point_then_a_move_that_must_load_waits_until_it_cools(
    live, tmp_path, tiny_pair_dirs
):
    """A load is seconds of full CPU that no pace governs. Past T_throttle the governor's serious rung (the
    smaller model, not loaded) waits: the loaded bigger model serves, paced, and stays loaded. Below
    T_throttle (still serious) the move loads the smaller model and the bigger one goes."""
    from governor.governor import Governor
    from governor.policy import PolicyConfig
    from server.serving.governor_gate import GovernorGate
    from tests.governor.fakes import FakeSensor

    # what loads at start is part of the setup: no stand-in (tested on its own)
    overrides = {"model": "tiny-big", "ladder": "tiny-big:f32,tiny-small:f32", "context_length": 128}
    overrides["cold_start"] = "wait"
    settings = make_settings(tmp_path, **overrides)
    served = serve_folders(settings, list(tiny_pair_dirs))
    sensor = FakeSensor(30.0, throttle_c=43.0, critical_c=48.0)  # cool: the bigger model loads at start
    governor = Governor(
        thermal=sensor,
        config=PolicyConfig(forecast_s=0.0, min_dwell_s=0.0),  # a step is a level, not a trend
        usable_cpus=2,
        ladder=served.ladder,
        start_rung=0,
        poll_s=0.02,
    )
    srv = live(served=served, governor=GovernorGate(governor), **overrides)
    srv.app.state.runtime.worker.placement.keep_warm = None  # the move down sheds the bigger model
    wait_ready(srv)
    assert loaded_now(srv) == {"tiny-big"}
    sensor.celsius = 44.0  # past T_throttle: serious, whose rung is tiny-small
    for _ in range(250):
        if governor.snapshot().level == "serious":
            break
        time.sleep(0.02)
    limits = governor.snapshot().limits
    assert (limits.model_id, limits.rung_held) == ("tiny-big", True)
    assert complete(srv, None).json()["model"] == "tiny-big"
    assert loaded_now(srv) == {"tiny-big"} and served.pool.loads == 1
    sensor.celsius = 42.0  # below T_throttle, still serious: the move may load now
    for _ in range(250):
        if not governor.snapshot().limits.rung_held:
            break
        time.sleep(0.02)
    assert governor.snapshot().level == "serious"
    assert complete(srv, None).json()["model"] == "tiny-small"
    wait_loaded(srv, {"tiny-small"})  # the bigger model, idle above the rung, goes


def test_start_when_the_biggest_models_load_is_known_to_overheat_the_device_then_a_smaller_one_starts(
    live, tmp_path, tiny_pair_dirs
):
    """SIMMER_HOME keeps what each model's load heated this device by (load_heat.json). On a warm device
    whose room before critical is less than the bigger model's load, the start loads the smaller one, and
    its own load is measured and kept beside the other."""
    from governor.governor import Governor
    from server.serving.governor_gate import GovernorGate
    from server.serving.governor_setup import LOAD_HEAT_FILE, kept_load_heat
    from tests.governor.fakes import FakeSensor

    # what loads at start is part of the setup: no stand-in (tested on its own)
    overrides = {"model": "tiny-big", "ladder": "tiny-big:f32,tiny-small:f32", "context_length": 128}
    overrides["cold_start"] = "wait"
    settings = make_settings(tmp_path, **overrides)
    kept = settings.home / LOAD_HEAT_FILE
    kept.write_text(json.dumps({"psutil:fake": {"tiny-big": 10.0}}))
    served = serve_folders(settings, list(tiny_pair_dirs))
    assert served.preload == "tiny-big"  # the memory tier's pick
    sensor = FakeSensor(38.0, throttle_c=43.0, critical_c=48.0)  # 9 C of room before critical's 47 C
    governor = Governor(
        thermal=sensor, usable_cpus=2, ladder=served.ladder, poll_s=0.02, load_heat=kept_load_heat(kept)
    )
    srv = live(served=served, governor=GovernorGate(governor), **overrides)
    wait_ready(srv)
    assert loaded_now(srv) == {"tiny-small"} and served.pool.loads == 1
    assert complete(srv, None).json()["model"] == "tiny-small"
    assert json.loads(kept.read_text()) == {"psutil:fake": {"tiny-big": 10.0, "tiny-small": 0.0}}


@pytest.mark.parametrize(
    "text", [b"\xff\xfe not utf-8", b"{not json", b'{"psutil:fake": {"tiny-big": "hot"}}']
)
def test_start_when_the_kept_load_heat_is_damaged_then_it_is_measured_again(
    live, tmp_path, tiny_pair_dirs, text
):
    from governor.governor import Governor
    from server.serving.governor_gate import GovernorGate
    from server.serving.governor_setup import LOAD_HEAT_FILE, kept_load_heat
    from tests.governor.fakes import FakeSensor

    # what loads at start is part of the setup: no stand-in (tested on its own)
    overrides = {"model": "tiny-big", "ladder": "tiny-big:f32,tiny-small:f32", "context_length": 128}
    overrides["cold_start"] = "wait"
    settings = make_settings(tmp_path, **overrides)
    kept = settings.home / LOAD_HEAT_FILE
    kept.write_bytes(text)
    served = serve_folders(settings, list(tiny_pair_dirs))
    sensor = FakeSensor(38.0, throttle_c=43.0, critical_c=48.0)
    governor = Governor(
        thermal=sensor, usable_cpus=2, ladder=served.ladder, poll_s=0.02, load_heat=kept_load_heat(kept)
    )
    srv = live(served=served, governor=GovernorGate(governor), **overrides)
    wait_ready(srv)
    assert loaded_now(srv) == {"tiny-big"}
    assert json.loads(kept.read_text()) == {"psutil:fake": {"tiny-big": 0.0}}


def test_continuation_when_a_prompt_of_token_ids_moves_to_another_tokenizer_then_the_text_they_spell(
    tiny_pair_dirs, tiny_spm_dir
):
    """A completion asked as token ids, handed over to a model with another tokenizer: the new model's
    prompt is the text those ids spell in the old model's vocabulary, then the reply so far."""
    from types import SimpleNamespace

    from server.serving.placement import continuation

    old = load_engine(tiny_pair_dirs[0], threads=1, context_length=128)
    new = load_engine(tiny_spm_dir, threads=1, context_length=128)
    text = "once upon a time"
    ids = tuple(old.text_prompt(text).ids)
    params = SimpleNamespace(max_tokens=8, truncate=False)
    job = SimpleNamespace(request=SimpleNamespace(payload=ids, params=params))
    handover = SimpleNamespace(generated=3, text=" there")
    spelled = b"".join(old.token_bytes(t) for t in ids).decode("utf-8", "replace")
    assert text in spelled
    got = continuation(new, job, handover, old)  # type: ignore[arg-type]
    assert got.ids == new.continuation_prompt(spelled, " there", reserve=1).ids
