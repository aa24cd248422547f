"""ChunkReader (pure): upstream chunks -> the worker's events, on a fake clock."""

from __future__ import annotations

from server.routing.relay import MAX_RELAY_TEXT_BYTES, MAX_RELAY_TOKENS, ChunkReader


def text_chunk(text: str, finish=None, logprobs=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def test_reader_when_completion_logprobs_then_one_event_per_token() -> None:
    r = ChunkReader("text", started_at=10.0)
    lp = {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1}, {}],
        "text_offset": [0, 1],
    }
    events = r.feed(text_chunk("ab", logprobs=lp), now=10.5)
    assert [(e.text, e.logprob, e.index) for e in events] == [("a", -0.1, 0), ("b", -0.2, 1)]
    assert events[0].top_logprobs[0].token == "a" and events[0].elapsed_ms == 500.0


def test_reader_when_logprob_tokens_do_not_add_up_then_text_kept_exact() -> None:
    r = ChunkReader("text", started_at=0.0)
    lp = {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]}
    events = r.feed(text_chunk("\u00e9", logprobs=lp), now=1.0)  # bytes held by the upstream's detokenizer
    assert "".join(e.text for e in events) == "\u00e9" and [e.logprob for e in events] == [-1.0, -2.0]


def test_reader_when_role_only_and_other_choices_then_no_events() -> None:
    r = ChunkReader("chat", started_at=0.0)
    assert r.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.1) == []
    assert r.feed({"choices": [{"index": 1, "delta": {"content": "other"}}]}, 0.2) == []
    assert not r.started


def test_reader_finish_when_usage_sent_then_usage_and_timings_from_it() -> None:
    r = ChunkReader("chat", started_at=100.0)
    r.feed({"choices": [{"index": 0, "delta": {"content": "hi"}}]}, now=100.2)
    r.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "content_filter"}]}, now=100.3)
    r.feed(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 6},
            },
        },
        100.3,
    )
    finish = r.finish(now=101.2)
    assert finish.finish_reason == "stop"  # OpenAI's other reasons end a reply like stop does
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.usage.cached_tokens) == (
        8,
        4,
        6,
    )
    t = finish.timings
    assert round(t.ttft_ms) == 200 and round(t.predicted_ms) == 1000 and t.predicted_per_second == 4.0


def chat_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_reader_when_max_tokens_reached_then_full_and_length() -> None:
    r = ChunkReader("chat", started_at=0.0, max_tokens=3)
    got = [e for i in range(10) for e in r.feed(chat_chunk(f"t{i}"), now=i)]
    assert [e.text for e in got] == ["t0", "t1", "t2"] and r.full
    assert r.finish(now=11.0).finish_reason == "length"


def test_reader_when_no_max_tokens_then_bounded_by_tokens_and_text() -> None:
    r = ChunkReader("chat", started_at=0.0)
    assert r.max_tokens == MAX_RELAY_TOKENS
    big = "x" * (1 << 20)
    got = [e for _ in range(10) for e in r.feed(chat_chunk(big), now=1.0)]
    assert len(got) == MAX_RELAY_TEXT_BYTES >> 20 and r.full  # 4 MiB of text, then nothing more


def test_reader_when_numbers_out_of_range_then_ignored_not_a_crash() -> None:
    r = ChunkReader("chat", started_at=0.0)
    logprobs = {
        "content": [
            {
                "token": "hi",
                "logprob": float("inf"),
                "bytes": ["not", "ints"],
                "top_logprobs": [{"token": "hi", "logprob": -(10**400)}, {"token": "h", "logprob": -0.5}],
            }
        ]
    }
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": logprobs}]}
    (event,) = r.feed(chunk, now=0.5)
    assert event.logprob is None and [t.token for t in event.top_logprobs] == ["h"]
    assert r.feed({"choices": [{"index": 0, "delta": "x"}], "usage": {"prompt_tokens": 10**400}}, 0.6) == []
    assert r.feed({"choices": "not a list"}, 0.7) == []
    finish = r.finish(now=1.0)
    assert finish.usage.prompt_tokens == 0 and finish.timings.prompt_per_second == 0.0
