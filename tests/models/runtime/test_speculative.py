"""Prompt-lookup speculative decoding: the drafter, the draft-length policy, the acceptance rule (pure), and
the engine's replies with speculation on and off, token for token (tiny model fast, SmolLM2 slow)."""

from __future__ import annotations

import numpy as np
import pytest

from models.protocol import Prompt
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.sampling import draw
from models.runtime.speculative import DraftPolicy, NgramDrafter, RowCost, expected_tokens
from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0.0)


# -- the drafter ---------------------------------------------------------------------------------------
def test_propose_when_tail_seen_before_then_its_latest_continuation() -> None:
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]) == 7  # the latest occurrence wins
    assert d.propose([4, 5, 6]) is None  # nothing repeats
    assert d.propose([8, 1, 2, 8]) == 1  # a 1-gram when no longer tail matches


def test_draft_when_copying_then_continues_through_its_own_proposals() -> None:
    d = NgramDrafter()
    history = [10, 11, 12, 13, 14, 15, 99, 10, 11]
    assert d.draft(history, 4) == [12, 13, 14, 15]
    assert d.draft(history, 2) == [12, 13]
    # the history grows by appends (indexed incrementally) and may restart (a new request)
    history += [12, 13, 14]
    assert d.draft(history, 3) == [15, 99, 10]
    assert d.draft([5, 6, 5], 2) == [6, 5]


# -- the draft length ------------------------------------------------------------------------------------
def test_expected_tokens_when_geometric_acceptance_then_closed_form() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_draft_length_when_acceptance_low_then_off_and_when_high_then_long() -> None:
    """Rule: k maximises expected tokens per pass over the pass's cost 1 + c*k; k = 0 unless a draft
    clearly pays."""
    policy = DraftPolicy(max_draft=8)
    for _ in range(50):
        policy.observe(False)
    assert policy.draft_length(row_cost=0.1, limit=8) == 0
    for _ in range(100):
        policy.observe(True)
    assert policy.draft_length(row_cost=0.1, limit=8) == 8
    assert policy.draft_length(row_cost=0.1, limit=3) == 3  # the room left
    assert policy.draft_length(row_cost=1.0, limit=8) == 0  # a row costing a pass: nothing to gain
    for i in range(200):  # acceptance ~0.7
        policy.observe(i % 10 < 7)
    assert 0 < policy.draft_length(row_cost=0.3, limit=8) < 5


# -- the acceptance rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("proposal", [0, 2, 3, 7])
@pytest.mark.parametrize("ids", [None, np.array([3, 0, 2, 5])])
def test_acceptance_when_coupled_with_the_draw_then_leviathans_rule(ids, proposal) -> None:
    """Accepting a point-mass draft x when the plain draw gives x is speculative sampling: over the
    uniform, acceptance has probability p(x) (min(1, p(x)/q(x)) with q(x) = 1), and a rejected position's
    token is distributed as p without x, renormalised (7 is not a candidate: always rejected)."""
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    tokens = list(range(4)) if ids is None else ids.tolist()
    n = 10_000
    drawn = np.array([draw(ids, probs, (i + 0.5) / n) for i in range(n)])
    p_x = probs[tokens.index(proposal)] if proposal in tokens else 0.0
    assert np.mean(drawn == proposal) == pytest.approx(p_x, abs=1e-3)
    rejected = drawn[drawn != proposal]
    residual = np.where(np.array(tokens) == proposal, 0.0, probs)
    got = np.array([np.mean(rejected == t) for t in tokens])
    np.testing.assert_allclose(got, residual / residual.sum(), atol=1e-3)


# -- the engine --------------------------------------------------------------------------------------------
def run(
    engine: DecoderEngine, prompt: Prompt, params: GenerationParams
) -> tuple[list[TokenEvent], FinishEvent]:
    events = list(engine.generate(prompt, params))
    assert isinstance(events[-1], FinishEvent)
    return events[:-1], events[-1]  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir) -> tuple[DecoderEngine, DecoderEngine]:
    kw = dict(variant="q4", threads=1, context_length=256)
    return load_engine(tiny_model_dir, speculation="auto", **kw), load_engine(
        tiny_model_dir, speculation="off", **kw
    )


COPY_TEXT = "the cat sat on the mat and the dog sat on the log and the cat sat on the mat " * 3


@pytest.mark.parametrize("logprobs", [None, 3])
def test_greedy_when_speculating_then_same_tokens_and_logprobs_as_plain(tiny_pair, logprobs) -> None:
    spec, plain = tiny_pair
    params = GenerationParams(SamplingParams(temperature=0.0, logprobs=logprobs), max_tokens=60)
    a, fa = run(spec, spec.text_prompt(COPY_TEXT), params)
    b, fb = run(plain, plain.text_prompt(COPY_TEXT), params)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert "".join(t.text for t in a) + fa.text == "".join(t.text for t in b) + fb.text
    assert fa.finish_reason == fb.finish_reason
    assert fa.usage.completion_tokens == fb.usage.completion_tokens
    if logprobs:  # the rows themselves, not only their argmax (the tiny model's argmax rarely moves)
        np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], atol=1e-3)
        top_a = [[(x.token, x.logprob) for x in t.top_logprobs or ()] for t in a]
        top_b = [[(x.token, x.logprob) for x in t.top_logprobs or ()] for t in b]
        assert [[x[0] for x in t] for t in top_a] == [[x[0] for x in t] for t in top_b]
        np.testing.assert_allclose(
            [[x[1] for x in t] for t in top_a], [[x[1] for x in t] for t in top_b], atol=1e-3
        )
    # speculation happened and paid: drafts verified, some accepted (a tiny random model loops)
    assert fa.timings.draft_n_accepted > 0
    assert fb.timings.draft_n == 0


def test_greedy_when_speculating_with_stops_and_reuse_then_same_as_plain(tiny_pair) -> None:
    """A stop string ends the reply mid-draft; the next request reuses the KV prefix (the verified tokens
    past the reply's end are not in it)."""
    spec, plain = tiny_pair
    probe, _ = run(plain, plain.text_prompt(COPY_TEXT), GenerationParams(GREEDY, max_tokens=40))
    text = "".join(t.text for t in probe)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = GenerationParams(GREEDY, max_tokens=40, stop=(stop,))
    for _ in range(2):  # the second request reuses the first one's KV prefix
        a, fa = run(spec, spec.text_prompt(COPY_TEXT), params)
        b, fb = run(plain, plain.text_prompt(COPY_TEXT), params)
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert fa.finish_reason == fb.finish_reason == "stop"
    follow = spec.text_prompt(COPY_TEXT + text[:20])
    a, _ = run(spec, follow, GenerationParams(GREEDY, max_tokens=30))
    b, _ = run(plain, plain.text_prompt(COPY_TEXT + text[:20]), GenerationParams(GREEDY, max_tokens=30))
    assert [t.token_id for t in a] == [t.token_id for t in b]


def test_greedy_when_speculating_past_the_context_with_sliding_window_then_same_as_plain(
    tiny_model_dir,
) -> None:
    """Drafts stop at the KV buffer's end; the window shift rebuilds the slot as plain decoding does."""
    kw = dict(variant="q4", threads=1, context_length=64)
    spec = load_engine(tiny_model_dir, speculation="auto", **kw)
    plain = load_engine(tiny_model_dir, speculation="off", **kw)
    params = GenerationParams(SamplingParams(temperature=0.0, logprobs=1), max_tokens=100, truncate=True)
    text = COPY_TEXT[:60]
    a, fa = run(spec, spec.text_prompt(text), params)
    b, fb = run(plain, plain.text_prompt(text), params)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], atol=1e-3)
    assert fa.truncated and fb.truncated and fa.finish_reason == fb.finish_reason
    assert fa.timings.draft_n_accepted > 0


def test_speculation_when_off_then_plain(tiny_model_dir) -> None:
    off = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256, speculation="off")
    _, fin = run(off, off.text_prompt(COPY_TEXT), GenerationParams(GREEDY, max_tokens=30))
    assert fin.timings.draft_n == 0


# The tiny random model puts ~1 - 1e-5 on " " (id 35) everywhere: a bias brings it level with the next
# few tokens, so a seeded reply varies and drafts (mostly " " again) are accepted about half the time.
FLAT = ((35, -11.5),)


class FixedCost(RowCost):
    """An extra row's cost pinned (the real one is fitted from timings): these tests need drafts verified
    whatever the machine's load, and the replies must not depend on it anyway."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def sampling_pair(tiny_model_dir) -> tuple[DecoderEngine, DecoderEngine]:
    kw = dict(variant="q4", threads=1, context_length=256)
    spec = load_engine(tiny_model_dir, speculation="auto", **kw)
    spec._row_costs[spec.session_key()] = FixedCost(prior=0.05)
    return spec, load_engine(tiny_model_dir, speculation="off", **kw)


def sampled(seed: int, **kw) -> GenerationParams:
    return GenerationParams(
        SamplingParams(temperature=1.0, top_k=5, seed=seed, logit_bias=FLAT, **kw), max_tokens=8
    )


def test_sampled_when_speculating_then_same_seed_same_reply_as_plain(sampling_pair) -> None:
    """The drafted token is accepted when the sampler's own draw gives it (speculative.py), so a seeded
    reply is the plain one for the seed, with drafts verified and accepted along the way."""
    spec, plain = sampling_pair
    accepted = 0
    for seed in range(40):
        params = sampled(seed, logprobs=2)
        a, fa = run(spec, spec.text_prompt(COPY_TEXT), params)
        b, _ = run(plain, plain.text_prompt(COPY_TEXT), params)
        again, _ = run(spec, spec.text_prompt(COPY_TEXT), params)
        assert [t.token_id for t in a] == [t.token_id for t in b] == [t.token_id for t in again], seed
        np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], atol=1e-3)
        accepted += fa.timings.draft_n_accepted
    assert accepted >= 40  # of 320 tokens


def chi2_sf_4(x: float) -> float:
    """The chi-square survival function at 4 degrees of freedom (closed form for an even df)."""
    return float(np.exp(-x / 2) * (1 + x / 2))


def test_sampled_when_speculating_then_next_token_frequencies_are_the_models(sampling_pair) -> None:
    """Pearson's test: each emitted token's rank in the model's own distribution at its position (the
    sampler's pipeline over logits from feeding the reply one token at a time on a fresh cache) against
    the expected counts (the sum of those distributions). Fixed seeds: the outcome does not vary."""
    from models.runtime.sampling import Sampler, make_rng
    from models.runtime.session import KVCache

    spec, plain = sampling_pair
    prompt = spec.text_prompt(COPY_TEXT).ids
    sess = plain.session()
    kv = KVCache(sess.shape, len(prompt) + 16)
    first = sess.run(np.array(prompt), kv, 0).copy()
    observed, expected = np.zeros(5), np.zeros(5)
    accepted = tokens = 0
    for seed in range(300):
        params = sampled(seed)
        events, fin = run(spec, Prompt(list(prompt)), params)
        accepted += fin.timings.draft_n_accepted
        ids = [t.token_id for t in events]
        model = Sampler(params.sampling, make_rng(0))
        logits = first
        for j, token in enumerate(ids):
            cand, probs = model.distribution(logits, prompt + ids[:j])
            assert cand is not None and len(cand) == 5
            order = np.argsort(-probs, kind="stable")
            expected += probs[order] / probs.sum()
            rank = np.flatnonzero(cand[order] == token)
            assert rank.size, f"seed {seed}: token {j} has probability 0 under the model"
            observed[int(rank[0])] += 1
            logits = sess.run(np.array([token]), kv, len(prompt) + j).copy()
        tokens += len(ids)
    assert accepted >= 0.15 * tokens  # a good share of the tokens came from verification rows
    assert expected[-1] >= 5  # Pearson's approximation holds
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert chi2_sf_4(stat) > 1e-3, (observed, expected)


def test_greedy_when_constrained_then_decodes_plainly_and_same_reply(tiny_pair) -> None:
    """A grammar's reply does not speculate (DecoderEngine._speculation says why); its reply is the plain
    one. The prompt repeats the grammar's own words, so an unguarded engine drafts here."""
    from models.runtime.constraint import json_schema_grammar

    spec, plain = tiny_pair
    words = ["cat", "sat", "on", "the", "mat"]
    grammar = json_schema_grammar({"type": "array", "items": {"enum": words}, "maxItems": 40})
    text = '["cat", "sat", "on", "the", "mat", "cat", "sat", "on", "the", "mat", "cat", "sat", ' * 2
    params = GenerationParams(GREEDY, max_tokens=80, grammar=grammar)
    a, fa = run(spec, spec.text_prompt(text), params)
    b, _ = run(plain, plain.text_prompt(text), params)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert fa.timings.draft_n == 0


def test_handover_when_speculating_then_same_ids_as_plain_and_drafts_counted_over_both(
    tiny_pair_dirs,
) -> None:
    """A reply handed to another model mid-way: drafting ends with the first model (its verified rows and
    KV past the reply are dropped) and starts afresh on the second; the ids are the plain handover's."""
    from models.protocol import EngineLimits
    from models.types import Handover

    def handed(speculation: str) -> tuple[list[int], FinishEvent, DecoderEngine]:
        big, small = (
            load_engine(d, variant="f32", threads=1, context_length=256, speculation=speculation)
            for d in tiny_pair_dirs
        )
        params = GenerationParams(GREEDY, max_tokens=60, ignore_eos=True)
        out: list[int] = []
        hook = lambda: EngineLimits(model_id=small.model_id) if len(out) >= 25 else None  # noqa: E731
        events = big.generate(big.text_prompt(COPY_TEXT), params, step_hook=hook)
        for ev in events:
            if isinstance(ev, Handover):
                break
            out.append(ev.token_id)  # type: ignore[union-attr]
        assert isinstance(ev, Handover) and len(out) == 25
        # the last token is not fed yet (the switch comes at the checkpoint after it), as in plain decoding
        assert [slot.tokens for slot in big._slots] == [big.text_prompt(COPY_TEXT).ids + out[:-1]]
        *rest, fin = small.generate(None, params, resume=ev)
        assert isinstance(fin, FinishEvent)
        return out + [t.token_id for t in rest], fin, big

    ids_spec, fin_spec, _ = handed("auto")
    ids_plain, fin_plain, _ = handed("off")
    assert ids_spec == ids_plain and len(ids_spec) == 60
    assert fin_spec.usage.by_model == fin_plain.usage.by_model
    assert fin_spec.timings.draft_n_accepted > 0 and fin_plain.timings.draft_n == 0


def test_speculation_when_unknown_setting_then_invalid_parameter(tiny_model_dir) -> None:
    from models.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="speculation"):
        load_engine(tiny_model_dir, variant="q4", threads=1, speculation="on")


def test_speculation_setting_when_off_then_engines_from_engine_config_decode_plainly(
    tiny_model_dir, monkeypatch
) -> None:
    """SIMMER_SPECULATION reaches the engines every entry point opens (EngineConfig)."""
    from server.serving.engine_config import EngineConfig
    from server.settings import Settings

    for value, speculates in (("off", False), ("auto", True)):
        monkeypatch.setenv("SIMMER_SPECULATION", value)
        engine = EngineConfig.from_settings(Settings(), threads=1).open_dir(tiny_model_dir, variant="q4")
        assert engine.speculation == value and engine.speculates is speculates


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_greedy_when_smollm2_rewrite_then_identical_to_plain(smollm2_model_dir, variant) -> None:
    """q4's verification rows are exact, so it speculates; q4-a8's are not on onnxruntime 1.32's x86
    kernels (another summation order for one row, amplified by int8 activation rounding), so it must
    not."""
    from bench.workloads import workload_prompts

    kw = dict(variant=variant, threads=1, context_length=1024)
    spec = load_engine(smollm2_model_dir, speculation="auto", **kw)
    plain = load_engine(smollm2_model_dir, speculation="off", **kw)
    exact = spec.session().rows_exact
    assert exact or variant == "q4-a8"
    if exact:  # measured row costs follow the machine's load; this test is about identity, not speed
        spec._row_costs[spec.session_key()] = FixedCost(prior=0.1)
    prompts = workload_prompts(smollm2_model_dir, "rewrite")
    for name in ("correct",):
        params = GenerationParams(GREEDY, max_tokens=48 if exact else 16)
        a, fa = run(spec, Prompt(prompts[name]), params)
        b, _ = run(plain, Prompt(prompts[name]), params)
        assert [t.token_id for t in a] == [t.token_id for t in b], name
        if exact:
            assert fa.timings.draft_n_accepted > 8, name
        else:
            assert fa.timings.draft_n == 0


@pytest.mark.slow
def test_sampled_when_smollm2_rewrite_then_same_seed_same_reply_as_plain(smollm2_model_dir) -> None:
    """A seeded sampled reply on real SmolLM2 q4 speculates and is the plain reply for the seed."""
    from bench.workloads import workload_prompts

    kw = dict(variant="q4", threads=1, context_length=1024)
    spec = load_engine(smollm2_model_dir, speculation="auto", **kw)
    spec._row_costs[spec.session_key()] = FixedCost(prior=0.1)  # drafts whatever the machine's load
    plain = load_engine(smollm2_model_dir, speculation="off", **kw)
    prompt = Prompt(workload_prompts(smollm2_model_dir, "rewrite")["correct"])
    params = GenerationParams(SamplingParams(temperature=0.7, top_p=0.95, seed=5), max_tokens=48)
    a, fa = run(spec, prompt, params)
    b, _ = run(plain, prompt, params)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert fa.timings.draft_n_accepted > 0
