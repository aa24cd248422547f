"""A cold start that answers at once: the server is healthy while its model is built beside the worker; a
request for that model starts on a loaded smaller rung of the ladder (the stand-in, loaded first at start)
and hands over mid-reply once its model is loaded; a request that says so, or SIMMER_COLD_START=wait, waits
for it. A slow fake load (through the pool's real opener seam) makes the wait visible; the ladder is the
phone's shape (a bigger model, then one of another tokenizer)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from governor.limits import Rung
from server.serving.ladder import Target, stand_in, start_stand_in
from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings
from tests.server.fakes import PaceGate
from tests.server.serving import helpers
from tests.server.serving.helpers import reference

LOAD_S = 1.5  # the big model's load: an order of magnitude above a tiny model's first token
PACE = 25.0  # tokens/s: a 60-token reply outlives the load (2.4 s)
REPLY = 60  # tokens: the text so far re-tokenized plus the rest fits the 128-token context


# -- the rule table (serving/ladder.py stand_in) -----------------------------------------------------------
LADDER = [
    Rung("big", "q4", 0.02, 1.0, 900),
    Rung("big", "q4-a8", 0.01, 0.99, 900),
    Rung("mid", "q4", 0.01, 1, 400),
]
LADDER += [Rung("small", "q4", 0.005, 1.0, 100)]


@pytest.mark.parametrize(
    ("placed", "ready", "usable", "want"),
    [
        ("big", {"mid", "small"}, {"big", "mid", "small"}, ("mid", "q4")),  # the first loaded rung below
        ("big", {"small"}, {"big", "mid", "small"}, ("small", "q4")),  # skips one not loaded
        ("big", {"mid", "small"}, {"big", "small"}, ("small", "q4")),  # skips one that cannot serve the job
        ("big", set(), {"big", "mid", "small"}, None),  # nothing ready below: it waits
        ("mid", {"big"}, {"big", "mid", "small"}, None),  # never a bigger model than the one it was placed on
        ("small", {"big", "mid"}, {"big", "mid", "small"}, None),  # the cheapest has nothing below
        ("elsewhere", {"small"}, {"elsewhere", "small"}, None),  # not on the ladder: it waits
    ],
)
def test_stand_in_rule_table(placed, ready, usable, want) -> None:
    got = stand_in(LADDER, Target(placed, None, "requested"), ready.__contains__, usable.__contains__)
    assert (None if got is None else (got.model_id, got.variant)) == want
    if got is not None:
        assert got.reason == f"stands in while {placed} loads"


@pytest.mark.parametrize(
    ("start", "usable", "want"),
    [
        ("big", {"big", "mid", "small"}, "small"),  # the cheapest: it loads in a fraction of the time
        ("big", {"big", "mid"}, "mid"),  # the cheapest that can chat
        ("small", {"big", "mid", "small"}, None),  # nothing below the start model
        ("elsewhere", {"small"}, None),
        (None, {"small"}, None),
    ],
)
def test_start_stand_in_rule_table(start, usable, want) -> None:
    assert start_stand_in(LADDER, start, usable.__contains__) == want


# -- a live server whose start model loads slowly ------------------------------------------------------
def start_cold(live, tmp_path, dirs, **extra):
    """A server over `dirs` serving tiny-big with tiny-spm below it on the ladder, tiny-big's every load
    taking LOAD_S; replies paced at PACE. Returns (server, models opened in order, when it was started)."""
    overrides = {"model": "tiny-big", "ladder": "tiny-big:f32,tiny-spm:f32", "context_length": 128, **extra}
    served = serve_folders(make_settings(tmp_path, **overrides), dirs)
    opener, opened = served.pool.opener, []

    def slow(entry, variant, limits):
        opened.append(entry.id)
        if entry.id == "tiny-big":
            time.sleep(LOAD_S)
        return opener(entry, variant, limits)

    served.pool.opener = slow
    started = time.monotonic()
    srv = live(served=served, governor=PaceGate(PACE), **overrides)
    return srv, opened, started


def timed_stream(srv, max_tokens: int, **extra) -> tuple[float, str, list[str], list[dict], dict]:
    """A greedy stream for tiny-big: (when its first text came, the text, each chunk's model, the switches,
    the usage)."""
    return helpers.timed_stream(srv, "tiny-big", max_tokens, **extra)


@pytest.mark.parametrize("max_batch", [4, 1], ids=["batch-loop", "alone"])
def test_cold_start_when_the_model_loads_then_healthy_at_once_and_a_stand_in_answers_then_hands_over(
    live, tmp_path, tiny_pair_dirs, tiny_spm_dir, max_batch
) -> None:
    big_dir = tiny_pair_dirs[0]
    srv, opened, started = start_cold(live, tmp_path, [big_dir, tiny_spm_dir], max_batch=max_batch)
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "loading"
    assert time.monotonic() - started < LOAD_S / 2  # healthy long before the model is loaded
    sent = time.monotonic()
    first, text, names, switches, usage = timed_stream(srv, REPLY)

    assert first - sent < LOAD_S / 3  # the stand-in's first token, not the load's end
    assert opened == ["tiny-spm", "tiny-big"]  # the stand-in first: a fraction of the big one's load
    assert names[0] == "tiny-spm" and names[-1] == "tiny-big"
    assert [(s["old"], s["new"]) for s in switches] == [("tiny-spm/f32", "tiny-big/f32")]
    assert "tiny-big is loaded (tiny-spm stood in while it loaded)" in switches[0]["reason"]
    n_spm = switches[0]["tokens_before"]
    assert 0 < n_spm < REPLY and usage["models"] == {"tiny-spm": n_spm, "tiny-big": REPLY - n_spm}
    # nothing lost or repeated: the stand-in's greedy text, then the big model's from that text
    assert text == reference(tiny_spm_dir, big_dir, n_spm, REPLY, same_tokenizer=False)
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_cold_start_when_the_request_waits_for_its_model_then_only_it_answers(
    live, tmp_path, tiny_pair_dirs, tiny_spm_dir
) -> None:
    srv, opened, _ = start_cold(live, tmp_path, [tiny_pair_dirs[0], tiny_spm_dir])
    sent = time.monotonic()
    first, _, names, switches, _ = timed_stream(srv, 8, wait_for_model=True)
    assert set(names) == {"tiny-big"} and switches == []
    assert first - sent > LOAD_S / 2  # it waited for the load (the stand-in was there)
    assert opened == ["tiny-spm", "tiny-big"]


def test_cold_start_when_set_to_wait_then_no_stand_in_loads_and_requests_wait(
    live, tmp_path, tiny_pair_dirs, tiny_spm_dir
) -> None:
    srv, opened, _ = start_cold(live, tmp_path, [tiny_pair_dirs[0], tiny_spm_dir], cold_start="wait")
    assert httpx.get(srv.url + "/health").json()["status"] == "loading"
    sent = time.monotonic()
    first, _, names, switches, _ = timed_stream(srv, 8)
    assert set(names) == {"tiny-big"} and switches == [] and first - sent > LOAD_S / 2
    assert opened == ["tiny-big"]


def test_cold_start_when_two_clients_stream_then_both_stand_in_and_both_hand_over(
    live, tmp_path, tiny_pair_dirs, tiny_spm_dir
) -> None:
    big_dir = tiny_pair_dirs[0]
    srv, _, _ = start_cold(live, tmp_path, [big_dir, tiny_spm_dir])
    results: list[tuple] = []
    threads = [threading.Thread(target=lambda: results.append(timed_stream(srv, REPLY))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 2
    for _, text, names, switches, _ in results:
        assert names[0] == "tiny-spm" and names[-1] == "tiny-big" and len(switches) == 1
        assert text == reference(
            tiny_spm_dir, big_dir, switches[0]["tokens_before"], REPLY, same_tokenizer=False
        )


@pytest.mark.parametrize("wait", [True, False])
def test_wait_for_model_when_asked_in_each_openai_dialect_then_the_internal_request_carries_it(wait) -> None:
    from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
    from server.api.openai.translate import chat_draft, completion_draft
    from server.api.responses.requests import ResponsesRequest
    from server.api.responses.translate import draft

    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "wait_for_model": wait}
    )
    text = CompletionRequest.model_validate({"prompt": "hi", "wait_for_model": wait})
    responses = ResponsesRequest.model_validate({"input": "hi", "wait_for_model": wait})
    assert chat_draft(chat).wait_for_model is wait
    assert completion_draft(text).wait_for_model is wait
    assert draft(responses).wait_for_model is wait
