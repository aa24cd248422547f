"""The generation engine on the tiny converted model (fast) and on the real SmolLM2 (marked slow)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.errors import ContextLengthExceeded
from models.protocol import EngineLimits, Prompt
from models.runtime.engine import DecoderEngine, load_engine, window_split
from models.types import CancelToken, FinishEvent, GenerationParams, SamplingParams
from tests.margins import WIDE, greedy
from tests.models.runtime.helpers import GREEDY, in_chunks, run, text_of, warm_reuse
from tests.reference_llama import ReferenceLlama

TINY_CONTEXT = 128  # the tiny fixture's context: the window tests fill it


def test_greedy_when_tiny_model_then_matches_reference_argmax_chain(tiny_decoder, tiny_gguf):
    ref = ReferenceLlama(tiny_gguf)
    prompt = tiny_decoder.text_prompt("the cat sat on the mat")
    tokens, fin = run(tiny_decoder, prompt, GenerationParams(GREEDY, max_tokens=12))
    ids = list(prompt.ids)
    expected = []
    for _ in range(len(tokens)):
        nxt = int(ref.logits(ids)[-1].argmax())
        expected.append(nxt)
        ids.append(nxt)
    assert [t.token_id for t in tokens] == expected
    assert fin.usage.completion_tokens == len(tokens)


def test_generate_when_max_tokens_then_finish_length(tiny_decoder):
    tokens, fin = run(
        tiny_decoder,
        tiny_decoder.text_prompt("hello"),
        GenerationParams(SamplingParams(temperature=1.0, seed=1), max_tokens=5),
    )
    # a random tiny model may emit EOS early; it must never exceed the cap
    assert len(tokens) <= 5
    assert fin.finish_reason in ("length", "stop")


def test_seed_when_same_then_same_text_and_when_different_then_differs(tiny_decoder):
    p = tiny_decoder.text_prompt("once upon a time")

    def sample(seed: int) -> list[int]:
        tokens, _ = run(
            tiny_decoder, p, GenerationParams(SamplingParams(temperature=1.5, seed=seed), max_tokens=20)
        )
        return [t.token_id for t in tokens]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8) or sample(7) != sample(9)


def test_prefix_reuse_when_same_prompt_then_cached_and_same_output(tiny_decoder):
    p = tiny_decoder.text_prompt("the quick brown fox jumps over the lazy dog")
    a_tokens, a = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=8))
    b_tokens, b = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=8))
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens == warm_reuse(tiny_decoder, len(p.ids))
    assert [t.token_id for t in a_tokens] == [t.token_id for t in b_tokens]


def test_prefix_reuse_when_follow_up_turn_then_only_new_tokens_prefilled(tiny_decoder):
    first = [{"role": "user", "content": "hello there"}]
    tokens, fin = run(tiny_decoder, tiny_decoder.chat_prompt(first), GenerationParams(GREEDY, max_tokens=6))
    follow = [
        *first,
        {"role": "assistant", "content": text_of(tokens, fin)},
        {"role": "user", "content": "more"},
    ]
    p2 = tiny_decoder.chat_prompt(follow)
    _, fin2 = run(tiny_decoder, p2, GenerationParams(GREEDY, max_tokens=4))
    assert fin2.usage.cached_tokens >= in_chunks(tiny_decoder, len(tiny_decoder.chat_prompt(first).ids))
    assert fin2.timings.prompt_n == len(p2.ids) - fin2.usage.cached_tokens


def test_prefill_when_chunked_then_same_tokens_as_one_shot(tiny_model_dir):
    one = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefill_chunk=256)
    chunked = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefill_chunk=3)
    p = one.text_prompt("a long enough prompt to need several chunks of three tokens")
    a, _ = run(one, p, GenerationParams(GREEDY, max_tokens=10))
    b, _ = run(chunked, p, GenerationParams(GREEDY, max_tokens=10))
    assert [t.token_id for t in a] == [t.token_id for t in b]


def test_stop_when_sequence_spans_tokens_then_text_ends_before_it(tiny_decoder):
    p = tiny_decoder.text_prompt("stop words")
    tokens, fin = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=30))
    full = text_of(tokens, fin)
    # choose a stop that straddles the boundary between two generated tokens' texts
    texts = [t.text for t in tokens]
    i = next((k for k in range(2, len(texts)) if texts[k - 1] and texts[k]), None)
    if i is None:
        pytest.skip("the random tiny model produced no two adjacent text tokens")
    boundary = len("".join(texts[:i]))
    stop = full[boundary - 1 : boundary + 1]
    cut = full.find(stop)
    tokens2, fin2 = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=30, stop=(stop,)))
    assert fin2.finish_reason == "stop"
    assert text_of(tokens2, fin2) == full[:cut]


def test_stream_when_deltas_joined_then_equal_full_decode(tiny_decoder):
    tokens, fin = run(
        tiny_decoder,
        tiny_decoder.text_prompt("deltas"),
        GenerationParams(SamplingParams(temperature=1.2, seed=3), max_tokens=40),
    )
    ids = [t.token_id for t in tokens]
    assert text_of(tokens, fin) == tiny_decoder.tokenizer.decode(ids)
    assert "\ufffd" not in "".join(t.text for t in tokens) or "\ufffd" in tiny_decoder.tokenizer.decode(ids)


def test_cancel_when_set_mid_reply_then_stops_within_one_token(tiny_decoder):
    cancel = CancelToken()
    seen = []

    def hook():
        seen.append(1)
        if len(seen) == 3:
            cancel.cancel()
        return None

    tokens, fin = run(
        tiny_decoder,
        tiny_decoder.text_prompt("cancel me"),
        GenerationParams(GREEDY, max_tokens=50),
        cancel=cancel,
        step_hook=hook,
    )
    assert fin.finish_reason == "cancelled"
    assert len(tokens) <= len(seen)  # no token after the checkpoint that saw the cancel


def test_cancel_when_set_between_prefill_chunks_then_no_token(tiny_model_dir):
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefill_chunk=2)
    cancel = CancelToken()

    def hook():
        cancel.cancel()
        return None

    tokens, fin = run(
        eng,
        eng.text_prompt("a prompt of several chunks"),
        GenerationParams(GREEDY),
        cancel=cancel,
        step_hook=hook,
    )
    assert tokens == [] and fin.finish_reason == "cancelled"


def test_context_when_prompt_too_long_then_error_or_truncated(tiny_decoder):
    long = "word " * 400
    with pytest.raises(ContextLengthExceeded, match="context is 128 tokens"):
        tiny_decoder.text_prompt(long)
    p = tiny_decoder.text_prompt(long, truncate=True)
    assert p.truncated and len(p.ids) < 128
    msgs = (
        [{"role": "system", "content": "be brief"}]
        + [
            {"role": r, "content": f"turn {i} " + "blah " * 10}
            for i, r in enumerate(["user", "assistant"] * 6)
        ]
        + [{"role": "user", "content": "last question"}]
    )
    with pytest.raises(ContextLengthExceeded):
        tiny_decoder.chat_prompt(msgs)
    p = tiny_decoder.chat_prompt(msgs, truncate=True)
    text = tiny_decoder.tokenizer.decode(p.ids)
    assert p.truncated and "be brief" in text and "last question" in text and "turn 0" not in text


def test_sliding_window_when_thousands_of_turns_then_few_encodings_and_the_same_window(
    tiny_decoder, monkeypatch
):
    """The window's first start that fits is bisected: a hostile history of 2,000 turns costs a few dozen
    encodings (one per turn before: minutes of worker time for a 1 MB body), and the window is the one the
    turn-by-turn search finds: the newest turns that fit, starting with a user turn."""
    msgs = [{"role": "system", "content": "be brief"}] + [
        {"role": r, "content": f"t{i}" + " x" * (i % 3)} for i, r in enumerate(["user", "assistant"] * 1000)
    ]
    encodings: list[int] = []
    real = tiny_decoder.chat_ids

    def counted(messages, tools=None):
        encodings.append(len(messages))
        return real(messages, tools)

    monkeypatch.setattr(tiny_decoder, "chat_ids", counted)
    p = tiny_decoder.chat_prompt(msgs, truncate=True, reserve=8)
    assert p.truncated and len(encodings) <= 2 + 2 * 11  # log2(1,000 user starts) ~ 10
    kept = msgs[1 + p.dropped :]
    assert kept[0]["role"] == "user" and p.ids == real([msgs[0], *kept])
    assert len(p.ids) + 8 <= tiny_decoder.context_length
    earlier = [i for i in range(p.dropped) if msgs[1 + i]["role"] == "user"][-1]  # the previous user start
    assert len(real([msgs[0], *msgs[1 + earlier :]])) + 8 > tiny_decoder.context_length  # it did not fit


@pytest.mark.parametrize("contexts", [None, 3])
def test_sliding_window_when_no_or_huge_max_tokens_then_bounded_at_window_reply_contexts(
    tiny_model_dir, contexts
):
    """Under truncate the context never runs out: a reply that no EOS ends (ignore_eos here) stops after
    window_reply_contexts contexts' worth of tokens (default WINDOW_REPLY_CONTEXTS), with finish_reason
    length, whether max_tokens is left out or huge, instead of running until its client leaves."""
    from models.runtime.engine import WINDOW_REPLY_CONTEXTS

    extra = {} if contexts is None else {"window_reply_contexts": contexts}
    engine = load_engine(
        tiny_model_dir, variant="q4", threads=1, context_length=16, prefill_chunk=256, **extra
    )
    bound = (contexts or WINDOW_REPLY_CONTEXTS) * 16
    for max_tokens in (None, 10**300, bound + 1):
        params = GenerationParams(GREEDY, max_tokens=max_tokens, truncate=True, ignore_eos=True)
        # at most a few events past the bound: an unbounded reply fails here instead of running for ever
        events = list(
            itertools.islice(engine.generate(engine.text_prompt("once upon a time"), params), bound + 3)
        )
        *tokens, fin = events
        assert len(tokens) == bound and isinstance(fin, FinishEvent), max_tokens
        assert fin.finish_reason == "length" and fin.truncated
    capped, fin = run(
        engine,
        engine.text_prompt("once"),
        GenerationParams(GREEDY, max_tokens=bound - 1, truncate=True, ignore_eos=True),
    )
    assert len(capped) == bound - 1  # a smaller cap the request gives still rules


def test_variant_switch_when_mid_reply_then_reply_continues_coherently(tiny_decoder):
    p = tiny_decoder.text_prompt("switch variants")
    plain, _ = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=12))
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(variant="f32") if len(calls) == 4 else None

    switched, fin = run(tiny_decoder, p, GenerationParams(GREEDY, max_tokens=12), step_hook=hook)
    assert fin.variant == "f32"
    # the KV cache was rebuilt from the history once: every token exactly once, the last one not yet fed
    (slot,) = tiny_decoder._slots
    assert slot.tokens == [*p.ids, *(t.token_id for t in switched[:-1])]
    # q4 and f32 are both exact on this model: the greedy reply must not change at the switch
    assert [t.token_id for t in switched] == [t.token_id for t in plain]


def test_logprobs_when_asked_then_chosen_and_top_alternatives(tiny_decoder):
    tokens, _ = run(
        tiny_decoder,
        tiny_decoder.text_prompt("logprobs"),
        GenerationParams(SamplingParams(temperature=0.0, logprobs=3), max_tokens=3),
    )
    for t in tokens:
        assert t.logprob is not None and t.logprob <= 0
        assert t.top_logprobs is not None and len(t.top_logprobs) == 3
        assert np.isclose(t.top_logprobs[0].logprob, t.logprob, atol=1e-5)


# -- the real model ----------------------------------------------------------------------------------


# llama.cpp's ids for "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
KNOWN_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["q4", "q4-a8", "f32"])
def test_real_model_when_known_prompt_greedy_then_paris_where_decided(smollm2_model_dir, variant):
    """The text is asserted where every step is decided on this CPU (tests/margins.py: here each gap is
    1.4 logits or more), and the reply with logprobs is the reply without."""
    eng = load_engine(smollm2_model_dir, variant=variant, threads=2)
    measured = greedy(eng, Prompt(KNOWN_IDS), 32)
    tokens, fin = run(eng, Prompt(KNOWN_IDS), GenerationParams(GREEDY, max_tokens=32))
    assert [t.token_id for t in tokens] == measured.ids and fin.finish_reason == "stop"
    assert fin.usage.completion_tokens == len(tokens) > 0
    if measured.decided(WIDE[variant]):
        assert text_of(tokens, fin) == "The capital of France is Paris.", measured.margins


@pytest.mark.slow
def test_real_model_when_chat_template_then_the_exact_variants_agree(smollm2_model_dir):
    """With the template's default system prompt the fp32 reference prefers "The" over "L" by only 0.08
    logits: no text to assert on every CPU. The exact variants (q4 within 1e-4 logits of f32) must still
    give the same reply as each other, on any CPU."""
    replies = {}
    for variant in ("q4", "f32"):
        eng = load_engine(smollm2_model_dir, variant=variant, threads=2)
        p = eng.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
        replies[variant] = greedy(eng, p, 32)
    assert replies["q4"].ids == replies["f32"].ids and replies["q4"].text
    if replies["f32"].decided(WIDE["f32"]):
        assert replies["f32"].text == "The capital of France is Paris."


@pytest.mark.slow
def test_real_model_when_chinese_and_emoji_streamed_then_no_replacement_chars(smollm2_model_dir):
    eng = load_engine(smollm2_model_dir, threads=2)
    p = eng.chat_prompt([{"role": "user", "content": "Write 你好世界 and 🙂🎉 five times."}])
    tokens, fin = run(eng, p, GenerationParams(SamplingParams(temperature=0.0), max_tokens=40))
    ids = [t.token_id for t in tokens]
    assert "".join(t.text for t in tokens) + fin.text == eng.tokenizer.decode(ids)
    assert all("\ufffd" not in t.text for t in tokens)


def test_prefix_reuse_when_two_slots_then_two_conversations_alternate_cached(tiny_model_dir):
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefix_slots=2)
    a = eng.text_prompt("the first conversation is about cats")
    b = eng.text_prompt("a second one talks about dogs instead")
    run(eng, a, GenerationParams(GREEDY, max_tokens=4))
    run(eng, b, GenerationParams(GREEDY, max_tokens=4))
    _, fa = run(eng, a, GenerationParams(GREEDY, max_tokens=4))
    _, fb = run(eng, b, GenerationParams(GREEDY, max_tokens=4))
    assert fa.usage.cached_tokens == warm_reuse(eng, len(a.ids))
    assert fb.usage.cached_tokens == warm_reuse(eng, len(b.ids))
    one = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefix_slots=1)
    run(one, a, GenerationParams(GREEDY, max_tokens=4))
    run(one, b, GenerationParams(GREEDY, max_tokens=4))
    _, fa1 = run(one, a, GenerationParams(GREEDY, max_tokens=4))
    assert fa1.usage.cached_tokens < len(a.ids) - one.reuse_tail  # one slot: b evicted a


@pytest.mark.slow
def test_cancel_when_inside_one_long_prefill_chunk_then_run_terminated(smollm2_model_dir):
    """RunOptions.terminate stops a running onnxruntime Run between nodes: a 1500-token prompt in a single
    chunk takes over a second to prefill here; a cancel 50 ms in must end it long before that."""
    import threading
    import time

    eng = load_engine(smollm2_model_dir, variant="q4-a8", threads=2, prefill_chunk=4096)
    prompt = Prompt([int(x) for x in np.random.default_rng(0).integers(300, 40000, 1500)])
    t0 = time.perf_counter()
    run(eng, Prompt(prompt.ids[:50]), GenerationParams(GREEDY, max_tokens=1))  # warm up
    full_prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, fin = run(eng, prompt, GenerationParams(GREEDY, max_tokens=1))
    full_s = time.perf_counter() - t0
    eng.reset_cache()
    cancel = CancelToken()
    threading.Timer(0.05, cancel.cancel).start()
    t0 = time.perf_counter()
    tokens, fin = run(eng, prompt, GenerationParams(GREEDY, max_tokens=5), cancel=cancel)
    cancelled_s = time.perf_counter() - t0
    assert fin.finish_reason == "cancelled" and tokens == []
    assert cancelled_s < full_s / 2, (cancelled_s, full_s, full_prefill_s)
    # the engine is usable at once, and the half-written KV slot is not reused
    _, fin2 = run(eng, prompt, GenerationParams(GREEDY, max_tokens=1))
    assert fin2.finish_reason == "length" and fin2.usage.cached_tokens == 0


def test_variant_switch_when_during_prefill_then_prefill_restarts_and_matches(tiny_model_dir):
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128, prefill_chunk=3)
    p = eng.text_prompt("a prompt long enough for several chunks of three")
    plain, _ = run(eng, p, GenerationParams(GREEDY, max_tokens=6))
    eng.reset_cache()
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(variant="f32") if len(calls) == 3 else None  # between prefill chunks

    switched, fin = run(eng, p, GenerationParams(GREEDY, max_tokens=6), step_hook=hook)
    assert fin.variant == "f32"
    assert [t.token_id for t in switched] == [t.token_id for t in plain]
    assert eng._slots[0].tokens == [*p.ids, *(t.token_id for t in switched[:-1])]


def test_context_cap_when_lowered_mid_reply_then_window_slides(tiny_model_dir):
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    p = eng.text_prompt("shrink")
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(context_cap=24) if len(calls) == 2 else None

    params = GenerationParams(GREEDY, max_tokens=60, truncate=True, ignore_eos=True)
    tokens, fin = run(eng, p, params, step_hook=hook)
    assert len(tokens) == 60 and fin.finish_reason == "length" and fin.truncated
    assert fin.turns_dropped == 0  # a raw text has no turns: its tokens slide
    slot = eng._slots[0].tokens
    assert len(slot) <= 24 and [*p.ids, *(t.token_id for t in tokens[:-1])][-len(slot) :] == slot


def lower_cap_after(step: int, cap: int):
    """A step hook (the governor's seam) that lowers the context cap at its `step`-th call: the first call
    is before the prefill, the next ones after each token (the prefill is one chunk)."""
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(context_cap=cap) if len(calls) == step else None

    return hook


def chat_history(pairs: int = 5) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(pairs):
        messages += [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    return [*messages, {"role": "user", "content": "last question"}]


def test_context_cap_when_lowered_mid_chat_reply_then_whole_turns_dropped(tiny_model_dir):
    """The governor lowers the cap mid-reply under a chat prompt: the window drops the oldest turns whole
    (the KV is rebuilt from the system message, the newest turns that fit with the reply's room, and the
    reply so far), as the request's window does, not the context's newest half cut at some token. The reply
    goes on from that context: a fresh reply from it gives the same tokens."""
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256)
    messages = chat_history()
    system, turns = window_split(messages)
    p = eng.chat_prompt(messages, truncate=True)
    assert not p.truncated and 128 < len(p.ids) < 256 - 16
    params = GenerationParams(GREEDY, max_tokens=16, truncate=True, ignore_eos=True)
    tokens, fin = run(eng, p, params, step_hook=lower_cap_after(3, 128))  # after the reply's 2nd token
    reply = [t.token_id for t in tokens]
    assert len(reply) == 16 and fin.truncated and fin.turns_dropped > 0
    k = fin.turns_dropped
    assert turns[k]["role"] == "user"  # a window starts with a user turn
    kept = eng.chat_prompt(system + turns[k:]).ids
    assert eng._slots[0].tokens == [*kept, *reply[:-1]]  # no partial message, the whole reply
    # the newest turns that fit: one more turn pair would not leave room for the rest of the reply
    assert len(kept) + 16 <= 128 < len(eng.chat_prompt(system + turns[k - 2 :]).ids) + 16
    assert "be brief" in eng.tokenizer.decode(kept) and "question 0" not in eng.tokenizer.decode(kept)

    eng.reset_cache()
    again, _ = run(eng, Prompt([*kept, *reply[:2]]), GenerationParams(GREEDY, max_tokens=14, ignore_eos=True))
    assert [t.token_id for t in again] == reply[2:]


def test_context_cap_when_lowered_mid_reply_under_one_huge_turn_then_tokens_slide(tiny_model_dir):
    """No whole turn can go (the prompt is one long question): the window keeps the context's newest half,
    tokens, as a raw text's does; the reply still goes on and says it was truncated."""
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "blah " * 40}]
    p = eng.chat_prompt(messages)
    params = GenerationParams(GREEDY, max_tokens=16, truncate=True, ignore_eos=True)
    tokens, fin = run(eng, p, params, step_hook=lower_cap_after(3, 64))
    assert len(tokens) == 16 and fin.truncated and fin.turns_dropped == 0
    full = [*p.ids, *(t.token_id for t in tokens[:-1])]
    slot = eng._slots[0].tokens
    assert len(slot) <= 64 and full[-len(slot) :] == slot  # the context's end, cut at a token


def test_context_cap_when_lowered_mid_reply_and_the_template_refuses_fewer_turns_then_tokens_slide(
    tiny_model_dir,
):
    """A chat template that raises for the shorter history (raise_exception): the reply goes on, its
    context slid by tokens, instead of failing mid-way."""
    strict = (
        "{% if messages|length < 12 %}{{ raise_exception('the whole history, please') }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256, chat_template=strict)
    p = eng.chat_prompt(chat_history())
    params = GenerationParams(GREEDY, max_tokens=16, truncate=True, ignore_eos=True)
    tokens, fin = run(eng, p, params, step_hook=lower_cap_after(3, len(p.ids) - 8))
    assert len(tokens) == 16 and fin.finish_reason == "length" and fin.truncated and fin.turns_dropped == 0


def test_context_cap_when_raised_above_the_slot_buffer_then_buffer_grows(tiny_model_dir):
    eng = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    eng.apply_limits(EngineLimits(context_cap=24))  # e.g. the governor at "serious": slots are small
    p = eng.text_prompt("grow")
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(context_cap=128) if len(calls) == 2 else None  # cooled down mid-reply

    tokens, fin = run(eng, p, GenerationParams(GREEDY, max_tokens=60, ignore_eos=True), step_hook=hook)
    assert len(tokens) == 60 and not fin.truncated
    assert eng._slots[0].cache.capacity >= len(p.ids) + 59


@pytest.mark.parametrize(
    ("setting", "governor", "threads", "spins"),
    [
        ("auto", None, 2, True),  # unpaced, no word from the governor: spin
        ("auto", False, 2, False),  # the governor paces (a CPU budget or a tokens/s pace): no spinning
        ("on", False, 2, True),  # the operator's choice stands
        ("off", None, 2, False),
        ("auto", None, 1, False),  # one thread: no pool to spin
        ("on", None, 1, False),
    ],
)
def test_pool_spins_when_setting_governor_and_threads_then_the_rule_table(setting, governor, threads, spins):
    from models.protocol import pool_spins

    assert pool_spins(setting, governor, threads) is spins


def test_apply_limits_when_the_governor_says_no_spinning_then_a_quiet_session(tiny_model_dir):
    import json

    engine = DecoderEngine(
        tiny_model_dir, json.loads((tiny_model_dir / "manifest.json").read_text()), threads=2
    )
    assert engine.session_key()[2] is True  # auto, unpaced
    engine.apply_limits(EngineLimits(threads=2, spin=False))  # the governor paces: no spinning
    assert engine.session_key() == (engine.variant, 2, False)
    engine.session()
    assert list(engine._sessions) == [(engine.variant, 2, False)]  # the spinning one went (max_sessions 1)
    engine.apply_limits(EngineLimits(threads=2))
    assert engine.session_key()[2] is True


def test_apply_limits_when_one_thread_and_the_pace_comes_and_goes_then_the_same_session(
    tiny_model_dir, caplog
):
    import json

    engine = DecoderEngine(
        tiny_model_dir, json.loads((tiny_model_dir / "manifest.json").read_text()), threads=1
    )
    first = engine.session()
    caplog.set_level("INFO", logger="simmer.engine")
    for limits in (EngineLimits(threads=1, spin=False), EngineLimits(threads=1)):
        engine.apply_limits(limits)
        assert engine.session() is first  # one thread has no pool: paced or not, the same session
    assert not [r for r in caplog.records if r.getMessage().startswith("loaded ")]


def test_load_when_session_built_then_freed_heap_handed_back(tiny_model_dir, monkeypatch):
    """Building a session leaves freed heap with glibc; the engine trims it once the session exists."""
    import models.runtime.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "release_freed_memory", lambda: calls.append(1))
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    assert calls == [1]
    engine.session()  # the same session again: nothing new to hand back
    assert calls == [1]
