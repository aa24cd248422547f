"""Replies taking turns (models/runtime/turns.py) on the tiny real model: each reply in one-row passes of its
own, one token per reply per round. Equality is with the one-reply engine (DecoderEngine.generate) with
speculation off, token ids and logprobs bit for bit, on every CPU and whatever the batch probe says (run
under `--batch-rows differ` too: no pass of turns has two rows)."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from models.errors import InvalidParameter
from models.protocol import EngineLimits, Prompt
from models.runtime import engine as engine_module
from models.runtime.batch import BatchDecoder, BatchTraits
from models.runtime.constraint import json_schema_grammar
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.turns import TurnDecoder
from models.types import (
    CancelToken,
    FinishEvent,
    GenerationParams,
    Handover,
    SamplingParams,
    TokenEvent,
    ToolUse,
)
from tests.models.runtime.helpers import (
    PERSON,
    SAMPLINGS,
    TEXTS,
    TIME,
    WEATHER,
    Events,
    calls_of,
    drive,
    finish,
    same_events,
    tokens,
)


def engine(folder, variant: str = "q4-a8", **kw) -> DecoderEngine:
    kw = {"threads": 1, "context_length": 128, "speculation": "off", **kw}
    return load_engine(folder, variant=variant, **kw)


def one_reply(e: DecoderEngine, prompt: Prompt, params: GenerationParams) -> Events:
    e.reset_cache()  # its whole prompt prefilled, as a turn's row that is compared with it
    return list(e.generate(prompt, params))  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["f32", "q4", "q4-a8"])
def test_turns_when_four_replies_take_turns_then_each_is_the_one_reply_engines_bit_for_bit(
    tiny_model_dir, variant
):
    e = engine(tiny_model_dir, variant)
    replies = {
        str(i): (e.text_prompt(t), GenerationParams(s, max_tokens=24, ignore_eos=True))
        for i, (t, s) in enumerate(zip(TEXTS, SAMPLINGS, strict=True))
    }
    together = drive(TurnDecoder(e, 4), replies)
    for key, (prompt, params) in replies.items():
        same_events(together[key], one_reply(e, prompt, params))
        assert len(tokens(together[key])) == 24


def test_turns_when_stops_grammar_tools_penalties_then_events_of_the_one_reply_engine(tiny_model_dir):
    e = engine(tiny_model_dir, context_length=256)
    seeded = SamplingParams(temperature=1.0, seed=3)
    replies = {
        "stop": (e.text_prompt("stop words"), GenerationParams(SAMPLINGS[0], max_tokens=30, stop=(" the",))),
        "json": (
            e.text_prompt("json"),
            GenerationParams(seeded, max_tokens=200, grammar=json_schema_grammar(PERSON)),
        ),
        "tools": (
            e.text_prompt("call"),
            GenerationParams(seeded, max_tokens=200, tools=ToolUse((WEATHER, TIME), choice="required")),
        ),
        "logprobs": (
            e.text_prompt("logprobs"),
            GenerationParams(replace(SAMPLINGS[1], logprobs=3), max_tokens=12),
        ),
    }
    together = drive(TurnDecoder(e, 4), replies)
    for key, (prompt, params) in replies.items():
        same_events(together[key], one_reply(e, prompt, params))
    jsonschema.validate(
        json.loads(
            "".join(t.text for t in together["json"] if isinstance(t, TokenEvent))
            + finish(together["json"]).text
        ),
        PERSON,
    )
    fin = finish(together["tools"])
    assert fin.finish_reason == "tool_calls" and calls_of(together["tools"][:-1], fin)


def test_turns_when_a_round_runs_then_one_one_row_pass_per_decoding_reply(tiny_model_dir, monkeypatch):
    e = engine(tiny_model_dir)
    widths: list[int] = []
    sess = e.session()
    run = sess.run

    def counted(ids, kv, past, *a, **kw):
        widths.append(kv.arrays[0][0].shape[0])  # the rows the pass's KV holds
        return run(ids, kv, past, *a, **kw)

    monkeypatch.setattr(sess, "run", counted)
    td = TurnDecoder(e, 3)
    params = GenerationParams(SAMPLINGS[0], max_tokens=8, ignore_eos=True)
    for t in TEXTS[:3]:
        td.add(e.text_prompt(t), params)
    while td.prefilling:
        td.prefill()
    widths.clear()
    before = e.positions_run
    events = td.step()
    assert widths == [1, 1, 1]  # three passes of one row, none of several
    assert e.positions_run - before == 3
    assert sorted(slot for slot, ev in events if isinstance(ev, TokenEvent)) == [0, 1, 2]
    assert td.last_pass is not None and td.last_pass.replies == 3


def test_turns_when_a_short_prompt_joins_three_long_replies_then_its_first_token_after_one_round(
    tiny_model_dir,
):
    """The batch loop's order (server/serving/batch_loop.py): a prefill chunk when one is due, then a round.
    The newcomer's first token comes after its prefill and at most one token of each running reply."""
    e = engine(tiny_model_dir, context_length=256)
    long = GenerationParams(SAMPLINGS[0], max_tokens=60, ignore_eos=True)
    td = TurnDecoder(e, 4)
    slots = [td.add(e.text_prompt(t), long) for t in TEXTS[:3]]
    while td.prefilling:
        td.prefill()
    for _ in range(5):
        td.step()
    short = td.add(e.text_prompt("hi"), GenerationParams(SAMPLINGS[0], max_tokens=4, ignore_eos=True))
    made = dict.fromkeys(slots, 0)
    first = None
    prefill_next = True
    while first is None:
        if td.prefilling and prefill_next:
            events, prefill_next = td.prefill(), False
        else:
            events, prefill_next = td.step(), True
        for slot, ev in events:
            if slot == short and isinstance(ev, TokenEvent):
                first = ev
            elif isinstance(ev, TokenEvent):
                made[slot] += 1
    assert max(made.values()) <= 1


def test_turns_when_a_client_leaves_during_anothers_turn_then_it_ends_without_its_pass(
    tiny_model_dir, monkeypatch
):
    e = engine(tiny_model_dir)
    params = GenerationParams(SAMPLINGS[1], max_tokens=16, ignore_eos=True)
    replies = {k: (e.text_prompt(t), params) for k, t in zip("abc", TEXTS, strict=False)}
    alone = {k: tokens(one_reply(e, *r)) for k, r in replies.items()}
    gone = CancelToken()
    td = TurnDecoder(e, 3)
    slots = {td.add(*replies["a"]): "a", td.add(*replies["b"]): "b", td.add(*replies["c"], cancel=gone): "c"}
    out: dict[str, Events] = {k: [] for k in "abc"}
    while td.prefilling:
        for slot, ev in td.prefill():
            out[slots[slot]].append(ev)
    for _ in range(3):
        for slot, ev in td.step():
            out[slots[slot]].append(ev)
    sess = e.session()
    run = sess.run
    passes: list[int] = []

    def leave_during_a(ids, kv, past, *a, **kw):  # c's client leaves while a's pass runs
        passes.append(past)
        gone.cancel()
        return run(ids, kv, past, *a, **kw)

    monkeypatch.setattr(sess, "run", leave_during_a)
    events = td.step()
    monkeypatch.undo()
    assert len(passes) == 2  # a's and b's; c ended before its own
    for slot, ev in events:
        out[slots[slot]].append(ev)
    assert finish(out["c"]).finish_reason == "cancelled" and td.free == 1
    while td.active:
        for slot, ev in td.prefill() if td.prefilling else td.step():
            out[slots[slot]].append(ev)
    assert tokens(out["a"]) == alone["a"] and tokens(out["b"]) == alone["b"]
    assert tokens(out["c"]) == alone["c"][: len(tokens(out["c"]))] and len(tokens(out["c"])) == 4


ALIKE = BatchTraits(rows=True, rows_alike=True, one_row_exact=True)
LONE_INEXACT = BatchTraits(rows=True, rows_alike=True, one_row_exact=False)
DIFFER = BatchTraits(rows=True, rows_alike=False, one_row_exact=False)
ONE_SEQUENCE = BatchTraits(rows=False)


# What the engine offers (SIMMER_BATCH, pad_batches, the probe's answer):
#   exact: a batch where rows are alike and a lone row exact (or padded, pad_batches); turns elsewhere
#   fast:  a batch wherever the graph has rows, unpadded where exact would not batch; turns for one sequence
@pytest.mark.parametrize(
    ("mode", "traits", "pad_batches", "kind", "pad"),
    [
        ("exact", ALIKE, False, BatchDecoder, None),
        ("exact", LONE_INEXACT, True, BatchDecoder, None),
        ("exact", LONE_INEXACT, False, TurnDecoder, False),
        ("exact", DIFFER, True, TurnDecoder, False),
        ("exact", ONE_SEQUENCE, True, TurnDecoder, False),
        ("fast", ALIKE, False, BatchDecoder, None),
        ("fast", LONE_INEXACT, False, BatchDecoder, False),
        ("fast", DIFFER, False, BatchDecoder, False),
        ("fast", ONE_SEQUENCE, False, TurnDecoder, False),
    ],
)
def test_engine_when_rows_cannot_share_a_pass_then_it_offers_turns_not_one_at_a_time(
    tiny_model_dir, monkeypatch, mode, traits, pad_batches, kind, pad
):
    e = engine(tiny_model_dir, batch=mode)
    monkeypatch.setattr(engine_module, "batch_traits", lambda sess: traits)
    monkeypatch.setattr(e, "pad_batches", pad_batches)
    decoder = e.batch_decoder(3)
    assert decoder is not None and type(decoder) is kind and decoder.slots == 3 and decoder.pad == pad
    assert e.batch_decoder(3) is decoder  # kept
    params = GenerationParams(SAMPLINGS[0], max_tokens=3, ignore_eos=True)
    if kind is TurnDecoder:
        out = drive(decoder, {"a": (e.text_prompt("hi"), params)})
        assert isinstance(out["a"][-1], FinishEvent) and len(tokens(out["a"])) == 3


def test_engine_when_batch_mode_unknown_then_refused(tiny_model_dir):
    with pytest.raises(InvalidParameter, match="exact or fast"):
        engine(tiny_model_dir, batch="fastest")


@pytest.mark.parametrize("variant", ["f32", "q4"])
def test_turns_when_the_session_speculates_then_each_reply_drafts_as_alone_and_its_tokens_are_its_own(
    tiny_model_dir, variant
):
    """Where the verification pass is exact (rows_exact) a reply speculates in turns as it does alone: the
    same tokens, logprobs up to summation order (a verification row is the plain one up to it, and draft
    lengths follow measured costs, so not even two lone runs are bit for bit the same); drafts verified."""
    e = engine(tiny_model_dir, variant, speculation="auto")
    if not e.speculates:
        pytest.skip(f"{e.model_id} {variant}: its verification pass is not exact here: nothing speculates")
    repeat = "one two three four one two three four one two three four"
    replies = {
        str(i): (e.text_prompt(t), GenerationParams(s, max_tokens=40, ignore_eos=True))
        for i, (t, s) in enumerate(zip([repeat, *TEXTS[:3]], SAMPLINGS, strict=True))
    }
    td = TurnDecoder(e, 4)
    keys = list(replies)
    slots = {td.add(*replies[k]): k for k in keys[:3]}
    together: dict[str, Events] = {k: [] for k in keys}
    for n in range(40):
        if n == 6:  # a prompt comes: its prefill runs between a reply's verification and its next token
            slots[td.add(*replies[keys[3]])] = keys[3]
        for slot, ev in td.prefill() if td.prefilling else td.step():
            together[slots[slot]].append(ev)
    while td.active:
        for slot, ev in td.prefill() if td.prefilling else td.step():
            together[slots[slot]].append(ev)
    drafted = 0
    for key, (prompt, params) in replies.items():
        alone = one_reply(e, prompt, params)
        mine, theirs = tokens(together[key]), tokens(alone)
        assert [t for t, _, _ in mine] == [t for t, _, _ in theirs], key
        assert all(abs(a - b) < 1e-4 for (_, a, _), (_, b, _) in zip(mine, theirs, strict=True)), key  # type: ignore[operator]
        drafted += finish(together[key]).timings.draft_n
    assert drafted > 0  # some reply did verify drafts in its turns


@pytest.mark.parametrize("speculation", ["off", "auto"])
def test_turns_when_handed_over_then_the_reply_goes_on_on_the_other_model_as_alone(
    tiny_pair_dirs, speculation
):
    """The governor moves one reply to a smaller model mid-turns: it goes on there, the one beside it stays,
    and its tokens are those the one-reply engine's reply makes when handed over at the same token."""
    big, small = (engine(d, speculation=speculation) for d in tiny_pair_dirs)
    params = GenerationParams(SamplingParams(temperature=0.0, logprobs=1), max_tokens=12, ignore_eos=True)
    prompt = big.text_prompt("one two three one two three one two three")
    made = iter(range(1 << 30))

    def at_five() -> EngineLimits | None:  # the lone reply's step hook, between its tokens
        return EngineLimits(model_id=small.model_id) if next(made) == 5 else None

    big.reset_cache()
    lone = list(big.generate(prompt, params, step_hook=at_five))
    assert isinstance(lone[-1], Handover)
    lone += list(small.generate(None, params, resume=lone[-1]))
    td, other = TurnDecoder(big, 2), TurnDecoder(small, 2)
    slot = td.add(prompt, params)
    beside = td.add(big.text_prompt(TEXTS[1]), params)
    seen: list[TokenEvent] = []
    while len(seen) < 5:
        events = td.prefill() if td.prefilling else td.step()
        seen += [ev for s, ev in events if s == slot and isinstance(ev, TokenEvent)]
    handover = td.hand_over(slot, EngineLimits(model_id=small.model_id))
    assert handover.generated == 5 and td.active == [beside]
    rest = drive(other, {"r": (None, params)}, resume=handover)["r"]
    fin = finish(rest)
    assert fin.usage.by_model == {big.model_id: 5, small.model_id: 7}
    ids = [t.token_id for t in [*seen, *rest] if isinstance(t, TokenEvent)]
    assert ids == [t.token_id for t in lone if isinstance(t, TokenEvent)]


@pytest.mark.parametrize("speculation", ["off", "auto"])
def test_turns_when_context_fills_then_window_slides_as_the_one_reply_engine(tiny_model_dir, speculation):
    e = engine(tiny_model_dir, context_length=48, speculation=speculation)
    windowed = GenerationParams(SAMPLINGS[0], truncate=True, ignore_eos=True)
    capped = GenerationParams(SAMPLINGS[3], max_tokens=70, ignore_eos=True)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = e.chat_prompt([*turns, {"role": "user", "content": "go"}])
    replies = {
        "window": (e.text_prompt(TEXTS[1]), windowed),
        "chat": (chat, windowed),
        "full": (e.text_prompt(TEXTS[0]), capped),
    }
    together = drive(TurnDecoder(e, 3), replies)
    for key, (prompt, params) in replies.items():
        alone = one_reply(e, prompt, params)
        if speculation == "off":
            same_events(together[key], alone)
        else:  # greedy: the same tokens (logprobs up to summation order)
            assert [t for t, _, _ in tokens(together[key])] == [t for t, _, _ in tokens(alone)], key
    assert finish(together["window"]).truncated and finish(together["chat"]).truncated
    assert finish(together["full"]).finish_reason == "length" and not finish(together["full"]).truncated


def test_turns_when_variant_switched_mid_reply_then_every_reply_prefills_again_and_goes_on(tiny_model_dir):
    """With speculation on: drafts verified on the old weights are dropped with the keys (as alone)."""
    e = engine(tiny_model_dir, "q4", speculation="auto")
    greedy = GenerationParams(SamplingParams(temperature=0.0), max_tokens=16, ignore_eos=True)
    repeat = "one two three one two three one two three"
    replies = {k: (e.text_prompt(t), greedy) for k, t in zip("ab", [repeat, TEXTS[1]], strict=True)}
    plain = drive(TurnDecoder(e, 2), replies)
    switched: list[list[int]] = []

    def switch(td, out: dict[str, Events]) -> None:
        if not switched and min(len(v) for v in out.values()) >= 4:
            switched.append(td.active)
            assert td.apply_limits(EngineLimits(variant="f32")) == []
            assert td.prefilling == switched[0] and td.decoding == []  # all of them, on the new weights
        return None

    out = drive(TurnDecoder(e, 2), replies, switch)
    assert e.variant == "f32" and all(finish(v).variant == "f32" for v in out.values())
    # q4 and f32 are both exact on this model: the greedy replies do not change at the switch
    assert {k: [t for t, _, _ in tokens(v)] for k, v in out.items()} == {
        k: [t for t, _, _ in tokens(v)] for k, v in plain.items()
    }


def test_turns_when_a_speculating_reply_goes_stale_then_its_verified_drafts_are_dropped(tiny_model_dir):
    """Rows verified before a variant switch are the old weights' logits: a reply alone drops them when it
    goes stale (Generation.advance), and so does its turn's prefill."""
    e = engine(tiny_model_dir, "q4", speculation="auto")
    td = TurnDecoder(e, 2)
    slot = td.add(e.text_prompt("one two three one two three one two three"), GenerationParams(SAMPLINGS[0]))
    row = td.rows[slot]
    assert row is not None and row.gen.spec is not None
    for _ in range(40):
        td.prefill() if td.prefilling else td.step()
        if row.gen.spec.pending is not None:
            break
    assert row.gen.spec.pending is not None  # drafted tokens verified, waiting to be used
    td.apply_limits(EngineLimits(variant="f32"))
    td.prefill()
    assert row.gen.spec.pending is None
