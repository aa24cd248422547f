"""Several replies decoding together (models/runtime/batch.py) on the tiny real model, and (slow) on SmolLM2.

Equality is asserted between two paths of the same engine: a reply alone and beside others, a reply in a
batch and through the one-reply engine (DecoderEngine.generate), token ids and logprobs bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from models.errors import ContextLengthExceeded, InvalidParameter
from models.protocol import EngineLimits, Prompt
from models.runtime.batch import BatchDecoder, RowError, batch_traits
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
    warm_reuse,
)
from tests.reference_llama import ReferenceLlama


def engine(folder: Path, variant: str = "q4-a8", **kw) -> DecoderEngine:
    """The engine, where this CPU's kernels give a batch's row the logits of the row alone (batch_traits).
    Elsewhere a batched reply's text depends on what runs beside it, which every test here compares: the
    test asserts what the server does there instead (replies take turns) and skips, saying so."""
    kw = {"threads": 1, "context_length": 128, "speculation": "off", **kw}
    e = load_engine(folder, variant=variant, **kw)
    traits = batch_traits(e.session())
    if traits.rows and not traits.rows_alike:
        assert isinstance(e.batch_decoder(4), TurnDecoder)
        pytest.skip(
            f"{e.model_id} {variant}: {traits.why_alone(pad=True)}; its replies take turns (test_turns)"
        )
    return e


def one_reply(e: DecoderEngine, prompt: Prompt, params: GenerationParams, **kw) -> Events:
    """The one-reply engine's events, its whole prompt prefilled (cached_tokens 0, as the batch's rows
    that are compared with it)."""
    e.reset_cache()
    return list(e.generate(prompt, params, **kw))  # type: ignore[arg-type]


def same_as_the_one_reply_engine(e: DecoderEngine, batched: dict[str, Events], replies: dict) -> None:
    """Each batched reply against the one-reply engine's. Where a lone row sums as a batch's rows do
    (batch_traits, measured at load) they are equal bit for bit. Elsewhere (AVX2, or q4's fp32 kernels)
    the one-reply engine's one-row passes round otherwise, so the check goes in two steps that hold on
    every CPU: the batch's reply decoded alone in one-row passes (pad=False: the one-reply engine's
    kernels) is the one-reply engine's, and the batched reply is the batch's reply alone (padded)."""
    exact = batch_traits(e.session()).one_row_exact
    for key, (prompt, params) in replies.items():
        mine = one_reply(e, prompt, params)
        if exact:
            same_events(batched[key], mine)
        else:
            same_events(drive(BatchDecoder(e, 1, pad=False), {key: (prompt, params)})[key], mine)
            same_events(batched[key], drive(BatchDecoder(e, 1), {key: (prompt, params)})[key])


# -- the same tokens whatever runs beside a reply ------------------------------------------------------------


def assert_batch_invariant(e: DecoderEngine, max_tokens: int) -> None:
    replies = {
        str(i): (e.text_prompt(t), GenerationParams(s, max_tokens=max_tokens, ignore_eos=True))
        for i, (t, s) in enumerate(zip(TEXTS, SAMPLINGS, strict=True))
    }
    alone = {k: tokens(drive(BatchDecoder(e, 4), {k: r})[k]) for k, r in replies.items()}
    for n in (2, 3, 4):
        together = drive(BatchDecoder(e, 4), dict(list(replies.items())[:n]))
        for k, events in together.items():
            assert tokens(events) == alone[k], (n, k)


@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_batch_when_a_reply_runs_beside_1_2_3_others_then_same_tokens_and_logprobs(tiny_model_dir, variant):
    assert_batch_invariant(engine(tiny_model_dir, variant), max_tokens=24)


@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_batch_when_a_lone_row_is_not_exact_then_one_reply_padded_to_two_rows(
    request, tiny_model_dir, variant
):
    """Where this CPU's kernels sum a one-row pass otherwise than a larger one (measured at load: q4's fp32
    kernels, and q4-a8's int8 ones on AVX2), a reply alone decodes in a pass of two rows and is the reply
    it is beside another; where they sum alike (q4-a8 on AVX-512 VNNI) it runs alone, the same reply."""
    e = engine(tiny_model_dir, variant)
    exact = batch_traits(e.session()).one_row_exact
    replies = {"0": (e.text_prompt(TEXTS[0]), GenerationParams(SAMPLINGS[0], max_tokens=8))}
    beside = drive(BatchDecoder(e, 2), {**replies, "1": (e.text_prompt(TEXTS[1]), replies["0"][1])})["0"]
    bd = BatchDecoder(e, 2)
    assert bd.pads is not exact
    assert tokens(drive(bd, replies)["0"]) == tokens(beside)
    assert bd.last_pass is not None and (bd.last_pass.replies, bd.last_pass.rows) == (1, 1 if exact else 2)
    if request.config.getoption("--batch-rows") == "measured":
        # what the probe measured shows in the reply: unpadded, its logprobs are a batch's only if exact
        unpadded = drive(BatchDecoder(e, 2, pad=False), replies)["0"]
        assert (tokens(unpadded) == tokens(beside)) is exact


def test_batch_when_rows_of_different_lengths_then_each_follows_the_reference(tiny_model_dir, tiny_gguf):
    """Every row decodes at its own position over its own past (GroupQueryAttention's per-row lengths):
    greedy replies of three prompt lengths, together, each the fp32 reference's argmax chain."""
    e = engine(tiny_model_dir, "f32")
    ref = ReferenceLlama(tiny_gguf)
    greedy = GenerationParams(SamplingParams(temperature=0.0), max_tokens=10, ignore_eos=True)
    prompts = {t: e.text_prompt(t) for t in ("a", "the quick brown fox jumps over", "sat on the mat")}
    out = drive(BatchDecoder(e, 3), {t: (p, greedy) for t, p in prompts.items()})
    for t, p in prompts.items():
        ids, expected = list(p.ids), []
        for _ in range(10):
            expected.append(int(ref.logits(ids)[-1].argmax()))
            ids.append(expected[-1])
        assert [tok for tok, _, _ in tokens(out[t])] == expected, t


def test_graph_when_batch_of_rows_then_onnxruntime_genai_decodes_them_too(tiny_model_dir):
    """The converted graph takes a batch of separate sequences in onnxruntime-genai too: its greedy ids
    for two prompts decoded together are ours for each alone."""
    import onnxruntime_genai as og

    from tests.models.runtime.helpers import ours_greedy

    model = og.Model(str(tiny_model_dir))
    prompts = [[1, 5, 17, 40, 33, 9], [7, 100, 200, 31, 5, 250]]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompts[0]) + 6, batch_size=2)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompts, np.int32))
    rows: list[list[int]] = [[], []]
    while not gen.is_done():
        gen.generate_next_token()
        for b, t in enumerate(np.asarray(gen.get_next_tokens()).reshape(-1)):
            rows[b].append(int(t))
    for prompt, row in zip(prompts, rows, strict=True):
        assert row == ours_greedy(tiny_model_dir, prompt, 6, context_length=64)


# -- per reply, what the one-reply engine does ---------------------------------------------------------------


def test_batch_when_stops_logprobs_grammar_tools_penalties_then_events_of_the_one_reply_engine(
    tiny_model_dir,
):
    e = engine(tiny_model_dir, context_length=256)
    free = one_reply(e, e.text_prompt("stop words"), GenerationParams(SAMPLINGS[0], max_tokens=30))
    texts = [t.text for t in free if isinstance(t, TokenEvent)]
    cut = next(k for k in range(2, len(texts)) if texts[k - 1] and texts[k])
    boundary = len("".join(texts[:cut]))
    stop = "".join(texts)[boundary - 1 : boundary + 1]
    seeded = SamplingParams(temperature=1.0, seed=3)
    replies = {
        "stop": (e.text_prompt("stop words"), GenerationParams(SAMPLINGS[0], max_tokens=30, stop=(stop,))),
        "json": (
            e.text_prompt("json"),
            GenerationParams(seeded, max_tokens=200, grammar=json_schema_grammar(PERSON)),
        ),
        "tools": (
            e.text_prompt("call"),
            GenerationParams(seeded, max_tokens=200, tools=ToolUse((WEATHER, TIME), choice="required")),
        ),
        "penalties": (
            e.text_prompt("again and again"),
            GenerationParams(
                SamplingParams(
                    temperature=0.8,
                    seed=1,
                    presence_penalty=1.0,
                    frequency_penalty=0.5,
                    logit_bias=((40, 5.0),),
                ),
                max_tokens=20,
            ),
        ),
        "logprobs": (
            e.text_prompt("logprobs"),
            GenerationParams(replace(SAMPLINGS[1], logprobs=3), max_tokens=12),
        ),
    }
    batched = drive(BatchDecoder(e, 4), dict(list(replies.items())[:4]))
    batched |= drive(BatchDecoder(e, 4), dict(list(replies.items())[4:]))
    same_as_the_one_reply_engine(e, batched, replies)
    assert finish(batched["stop"]).finish_reason == "stop"
    jsonschema.validate(
        json.loads(
            "".join(t.text for t in batched["json"] if isinstance(t, TokenEvent))
            + finish(batched["json"]).text
        ),
        PERSON,
    )
    fin = finish(batched["tools"])
    assert fin.finish_reason == "tool_calls" and calls_of(batched["tools"][:-1], fin)


def test_batch_when_context_fills_then_window_slides_as_the_one_reply_engine(tiny_model_dir):
    e = engine(tiny_model_dir, context_length=48)
    windowed = GenerationParams(SAMPLINGS[1], truncate=True, ignore_eos=True)
    capped = GenerationParams(SAMPLINGS[0], max_tokens=70, ignore_eos=True)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = e.chat_prompt([*turns, {"role": "user", "content": "go"}])
    replies = {
        "window": (e.text_prompt(TEXTS[1]), windowed),
        "chat": (chat, windowed),
        "full": (e.text_prompt(TEXTS[0]), capped),
    }
    batched = drive(BatchDecoder(e, 3), replies)
    same_as_the_one_reply_engine(e, batched, replies)
    assert finish(batched["window"]).truncated and finish(batched["chat"]).truncated
    assert finish(batched["full"]).finish_reason == "length" and not finish(batched["full"]).truncated


def test_batch_when_cap_lowered_mid_reply_then_windowed_rows_slide_and_the_others_end(tiny_model_dir):
    e = engine(tiny_model_dir, context_length=128)
    windowed = GenerationParams(SAMPLINGS[1], max_tokens=30, truncate=True, ignore_eos=True)
    plain = GenerationParams(SAMPLINGS[0], max_tokens=30, ignore_eos=True)
    lowered: list[int] = []

    def lower(bd: BatchDecoder, out: dict[str, Events]) -> list | None:
        if lowered or len(out["w"]) < 12:
            return None
        lowered.append(len(out["p"]))
        return bd.apply_limits(EngineLimits(context_cap=16))  # the plain reply no longer fits: it ends

    replies = {"w": (e.text_prompt(TEXTS[1]), windowed), "p": (e.text_prompt(TEXTS[2]), plain)}
    out = drive(BatchDecoder(e, 2), replies, lower)
    assert finish(out["p"]).finish_reason == "length" and len(out["p"]) == lowered[0] + 1
    assert finish(out["w"]).truncated and len(tokens(out["w"])) == 30


def test_batch_when_variant_switched_mid_reply_then_every_row_prefills_again_and_goes_on(tiny_model_dir):
    e = engine(tiny_model_dir, "q4")
    greedy = GenerationParams(SamplingParams(temperature=0.0), max_tokens=12, ignore_eos=True)
    replies = {k: (e.text_prompt(t), greedy) for k, t in zip("ab", TEXTS, strict=False)}
    plain = drive(BatchDecoder(e, 2), replies)
    switched: list[list[int]] = []

    def switch(bd: BatchDecoder, out: dict[str, Events]) -> None:
        if not switched and min(len(v) for v in out.values()) >= 4:
            switched.append(bd.active)
            assert bd.apply_limits(EngineLimits(variant="f32")) == []
            assert bd.prefilling == switched[0] and bd.decoding == []  # all of them, on the new weights
        return None

    out = drive(BatchDecoder(e, 2), replies, switch)
    assert e.variant == "f32" and all(finish(v).variant == "f32" for v in out.values())
    # q4 and f32 are both exact on this model: the greedy replies do not change at the switch
    assert {k: [t for t, _, _ in tokens(v)] for k, v in out.items()} == {
        k: [t for t, _, _ in tokens(v)] for k, v in plain.items()
    }


def test_batch_when_long_prompt_added_then_prefilled_a_chunk_a_call_while_others_stream(tiny_model_dir):
    e = engine(tiny_model_dir, prefill_chunk=4)
    params = GenerationParams(SAMPLINGS[1], max_tokens=30, ignore_eos=True)
    short, long = e.text_prompt("hi"), e.text_prompt(" ".join(TEXTS[:2]))
    alone = {
        k: tokens(drive(BatchDecoder(e, 2), {k: (p, params)})[k]) for k, p in (("a", short), ("b", long))
    }
    bd = BatchDecoder(e, 2)
    a = bd.add(short, params)
    out: dict[int, Events] = {a: [ev for _, ev in bd.prefill()]}  # one chunk: its first token
    b = bd.add(long, params)
    out[b] = []
    chunks, a_before_b = 0, None
    while bd.active:
        if bd.prefilling:  # a chunk of b's prompt, then a decode pass: a gets a token between chunks
            chunks += 1
            for slot, event in bd.prefill():
                out[slot].append(event)
                if slot == b and a_before_b is None:
                    a_before_b = len(out[a])
        for slot, event in bd.step():
            out[slot].append(event)
    assert len(long.ids) > 8 and chunks == -(-len(long.ids) // 4)
    assert a_before_b == chunks  # its first token, then one after each of b's chunks but the last
    assert tokens(out[a]) == alone["a"] and tokens(out[b]) == alone["b"]


def test_batch_when_cancelled_then_slot_free_at_once_and_the_others_unchanged(tiny_model_dir):
    e = engine(tiny_model_dir)
    params = GenerationParams(SAMPLINGS[1], max_tokens=16, ignore_eos=True)
    replies = {k: (e.text_prompt(t), params) for k, t in zip("abc", TEXTS, strict=False)}
    alone = {k: tokens(drive(BatchDecoder(e, 3), {k: r})[k]) for k, r in replies.items()}
    token = CancelToken()
    done: dict[str, FinishEvent] = {}

    def leave(bd: BatchDecoder, out: dict[str, Events]) -> None:
        if len(out["b"]) == 5 and "b" not in done:
            free = bd.free
            fin = bd.cancel(1)
            done["b"] = fin
            out["b"].append(fin)
            assert fin.finish_reason == "cancelled" and bd.free == free + 1
        if len(out["c"]) == 3:
            token.cancel()  # as another thread does when the client leaves: seen at the next call

    bd = BatchDecoder(e, 3)
    slots = {bd.add(*replies["a"]): "a", bd.add(*replies["b"]): "b", bd.add(*replies["c"], cancel=token): "c"}
    assert sorted(slots) == [0, 1, 2]
    out: dict[str, Events] = {k: [] for k in "abc"}
    while bd.active:
        for slot, event in bd.prefill() if bd.prefilling else bd.step():
            out[slots[slot]].append(event)
        leave(bd, out)
    assert tokens(out["a"]) == alone["a"]
    assert tokens(out["b"]) == alone["b"][:5]
    assert tokens(out["c"]) == alone["c"][:3] and finish(out["c"]).finish_reason == "cancelled"
    assert bd.active == [] and bd.free == 3


def test_batch_when_cancelled_during_prefill_then_no_token(tiny_model_dir):
    e = engine(tiny_model_dir, prefill_chunk=2)
    token = CancelToken()
    bd = BatchDecoder(e, 2)
    slot = bd.add(e.text_prompt(TEXTS[1]), GenerationParams(SAMPLINGS[0]), cancel=token)
    assert bd.prefill() == []
    token.cancel()
    ((s, fin),) = bd.step()
    assert s == slot and isinstance(fin, FinishEvent) and fin.finish_reason == "cancelled" and bd.free == 2


def test_batch_when_same_prompt_again_then_prefix_reused_within_its_scope(tiny_model_dir):
    e = engine(tiny_model_dir)
    params = GenerationParams(SAMPLINGS[0], max_tokens=6, ignore_eos=True)
    prompt = e.text_prompt("the quick brown fox jumps over the lazy dog")
    bd = BatchDecoder(e, 2)
    alice, bob = replace(params, cache_scope="alice"), replace(params, cache_scope="bob")
    first = drive(bd, {"x": (prompt, alice)})["x"]
    again = drive(bd, {"x": (prompt, alice)})["x"]
    other = drive(bd, {"x": (prompt, bob)})["x"]
    assert finish(first).usage.cached_tokens == 0 and finish(other).usage.cached_tokens == 0
    assert finish(again).usage.cached_tokens == warm_reuse(e, len(prompt.ids))
    # logprobs too (tests/models/runtime/test_prefix_exact.py)
    assert tokens(first) == tokens(again) == tokens(other)


def test_batch_when_handed_over_then_the_reply_goes_on_on_the_other_model(tiny_pair_dirs):
    big, small = (engine(d) for d in tiny_pair_dirs)
    params = GenerationParams(SAMPLINGS[1], max_tokens=12, ignore_eos=True)
    bd, other = BatchDecoder(big, 2), BatchDecoder(small, 2)
    slot = bd.add(big.text_prompt(TEXTS[0]), params)
    beside = bd.add(big.text_prompt(TEXTS[1]), params)
    seen: list[TokenEvent] = []
    while len(seen) < 5:
        events = bd.prefill() if bd.prefilling else bd.step()
        seen += [ev for s, ev in events if s == slot and isinstance(ev, TokenEvent)]
    handover = bd.hand_over(slot, EngineLimits(model_id=small.model_id))
    assert isinstance(handover, Handover) and handover.generated == 5 and bd.active == [beside]
    assert handover.text == "".join(t.text for t in seen)
    rest = drive(other, {"r": (None, params)}, resume=handover)["r"]
    fin = finish(rest)
    assert len(tokens(rest)) == 7 and fin.usage.completion_tokens == 12
    assert fin.usage.by_model == {big.model_id: 5, small.model_id: 7}


def test_batch_when_one_reply_fails_then_it_alone_ends_with_its_error(tiny_model_dir, monkeypatch):
    e = engine(tiny_model_dir)
    params = GenerationParams(SAMPLINGS[1], max_tokens=10, ignore_eos=True)
    alone = tokens(drive(BatchDecoder(e, 2), {"a": (e.text_prompt(TEXTS[0]), params)})["a"])
    bd = BatchDecoder(e, 2)
    a, b = bd.add(e.text_prompt(TEXTS[0]), params), bd.add(e.text_prompt(TEXTS[1]), params)
    out: dict[int, list] = {a: [], b: []}
    for _ in range(3):
        for slot, event in bd.prefill() if bd.prefilling else bd.step():
            out[slot].append(event)
    row = bd.rows[b]
    assert row is not None

    def broken(*args, **kw):
        raise RuntimeError("a sampler that fails")

    monkeypatch.setattr(row.gen.r.sampler, "sample", broken)
    while bd.active:
        for slot, event in bd.prefill() if bd.prefilling else bd.step():
            out[slot].append(event)
    assert isinstance(out[b][-1], RowError) and "fails" in str(out[b][-1].error)
    assert tokens(out[a]) == alone and finish(out[a]).finish_reason == "length"


# -- hostile use ---------------------------------------------------------------------------------------------


def test_batch_when_misused_then_clear_errors_and_no_slot_lost(tiny_model_dir):
    e = engine(tiny_model_dir, context_length=32)
    for slots in (0, -1):
        with pytest.raises(InvalidParameter):
            BatchDecoder(e, slots)
    bd = BatchDecoder(e, 1)
    assert bd.step() == [] and bd.prefill() == []
    ok = GenerationParams(SAMPLINGS[0], max_tokens=4)
    with pytest.raises(ContextLengthExceeded):
        bd.add(Prompt(list(range(3, 40))), ok)
    with pytest.raises(InvalidParameter):
        bd.add(e.text_prompt("x"), replace(ok, sampling=replace(ok.sampling, logit_bias=((10**9, 1.0),))))
    with pytest.raises(InvalidParameter):
        bd.add(e.text_prompt("x"), replace(ok, grammar=json_schema_grammar(PERSON), tools=ToolUse((TIME,))))
    assert bd.free == 1
    slot = bd.add(e.text_prompt("x"), ok)
    with pytest.raises(InvalidParameter):
        bd.add(e.text_prompt("y"), ok)
    with pytest.raises(ValueError):
        bd.prefill(slot + 1)
    with pytest.raises(ValueError):
        bd.cancel(slot + 1)
    assert bd.cancel(slot).finish_reason == "cancelled" and bd.free == 1


def test_batch_when_foreign_decoder_then_refused_with_a_clear_error(tiny_model_dir, tmp_path):
    from models.store.store import ModelStore
    from tests.models import genai_folders as gf

    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "separate", share_buffer=False)
    installed = ModelStore(tmp_path / "home").pull(str(folder))
    foreign = DecoderEngine(
        installed.path, installed.manifest, model_id=installed.id, threads=1, context_length=64
    )
    assert batch_traits(foreign.session()).rows is False
    with pytest.raises(InvalidParameter) as err:
        BatchDecoder(foreign, 2)
    assert "one sequence at a time" in err.value.message


# -- the real model ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_real_model_when_a_reply_runs_beside_1_2_3_others_then_same_tokens_and_logprobs(
    smollm2_model_dir, variant
):
    e = engine(smollm2_model_dir, variant, threads=2, context_length=512)
    assert_batch_invariant(e, max_tokens=40)


def test_batch_rows_when_one_client_at_a_time_then_one_row_mapped_and_more_only_for_replies_at_once(
    tiny_model_dir,
):
    params = GenerationParams(SAMPLINGS[0], max_tokens=3, ignore_eos=True)
    e = engine(tiny_model_dir)  # keeps one conversation's prefix (SIMMER_PREFIX_CACHE_SLOTS 1)
    bd = BatchDecoder(e, 4)
    alone = [drive(bd, {"x": (e.text_prompt(t), params)})["x"] for t in TEXTS]
    assert bd.kv.mapped == [True, False, False, False]  # each reply took the row the last one left
    together = drive(bd, {t: (e.text_prompt(t), params) for t in TEXTS[:2]})
    assert bd.kv.mapped == [True, True, False, False]
    assert tokens(together[TEXTS[0]]) == tokens(alone[0])  # a reused row's old keys never leak in

    kept = engine(tiny_model_dir, prefix_slots=2)  # two conversations kept: their rows both stay
    bd = BatchDecoder(kept, 4)
    first, second = (kept.text_prompt(t) for t in TEXTS[:2])
    for prompt in (first, second, first):
        last = drive(bd, {"x": (prompt, params)})["x"]
    assert bd.kv.mapped == [True, True, False, False]
    assert finish(last).usage.cached_tokens == warm_reuse(kept, len(first.ids))
