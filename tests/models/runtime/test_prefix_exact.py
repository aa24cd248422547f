"""A reply's text never depends on how much of its prompt was cached: cold, warm (the same prompt again),
partly warm (another prompt sharing a prefix), a follow-up whose cached prefix holds a decoded reply, and a
prompt split into chunks, all give the events of one cold prefill, token ids and logprobs bit for bit; on
the one-reply engine and in a batch. Equality between two paths of the same engine on the tiny real model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from models.protocol import Prompt
from models.runtime.batch import BatchDecoder
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.generation import passes_exact, positions_exact, reusable_prefix
from models.runtime.session import (
    Exactness,
    cold_pass,
    exact_prefix,
    measure_exactness,
    note_write,
    prefill_end,
)
from models.types import GenerationParams, SamplingParams, TokenEvent
from tests.models.runtime.helpers import Events, drive, finish, in_chunks, tokens

GREEDY = GenerationParams(SamplingParams(temperature=0.0, logprobs=2), max_tokens=8, ignore_eos=True)
SEEDED = replace(GREEDY, sampling=SamplingParams(temperature=1.2, seed=3, logprobs=2))
TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the dark forest"


def engine(folder, variant: str, **kw) -> DecoderEngine:
    kw = {"threads": 1, "context_length": 128, "speculation": "off", **kw}
    return load_engine(folder, variant=variant, **kw)


def generate(e: DecoderEngine, prompt: Prompt, params: GenerationParams) -> Events:
    return list(e.generate(prompt, params))  # type: ignore[arg-type]


def cached(events: list) -> int:
    return finish(events).usage.cached_tokens


def reuses(e: DecoderEngine, events: list, at_least: int) -> bool:
    """The reply reused at least `at_least` cached tokens; where this CPU's passes of several positions
    depend on their number (passes_exact), whole prefill chunks, at least those `at_least` holds."""
    n = cached(events)
    return n >= in_chunks(e, at_least) and in_chunks(e, n) == n


@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_when_cold_warm_partly_warm_or_chunked_then_same_tokens_and_logprobs(
    tiny_model_dir, variant, params
):
    e = engine(tiny_model_dir, variant)
    prompt = e.text_prompt(TEXT)
    n = len(prompt.ids)
    e.reset_cache()
    cold = generate(e, prompt, params)
    warm = generate(e, prompt, params)  # the whole prompt is in the slot but its last tokens
    assert cached(cold) == 0 and reuses(e, warm, n - 2)
    assert tokens(warm) == tokens(cold)
    for keep in (n - 1, n - 2, n - 3, n // 2):  # another prompt shares `keep` tokens first
        e.reset_cache()
        generate(e, Prompt([*prompt.ids[:keep], *e.tokenize(" zebra crossing")]), params)
        partly = generate(e, prompt, params)
        assert cached(partly) <= keep and reuses(e, partly, 1) and tokens(partly) == tokens(cold), keep
    if not passes_exact(e.session()):
        return  # a prompt a chunk at a time is passes of other numbers of positions: not the same there
    for chunk in (n - 1, n - 2, 4, 3, 2):  # cold, a chunk at a time
        chunked = engine(tiny_model_dir, variant, prefill_chunk=chunk)
        assert tokens(generate(chunked, prompt, params)) == tokens(cold), chunk


@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_prefix_when_follow_up_reuses_a_decoded_reply_then_same_tokens_as_cold(tiny_model_dir, variant):
    """The follow-up's cached prefix holds the first reply, whose keys one-position decode passes wrote: a
    cold prefill writes them in a pass of several, so (where those differ) they are prefilled again."""
    e = engine(tiny_model_dir, variant)
    first = e.text_prompt(TEXT)
    reply = [t.token_id for t in generate(e, first, GREEDY) if isinstance(t, TokenEvent)]
    follow = Prompt([*first.ids, *reply, *e.tokenize(" and so on")])
    warm = generate(e, follow, GREEDY)
    assert reuses(e, warm, len(first.ids) - 2)
    e.reset_cache()
    assert tokens(warm) == tokens(generate(e, follow, GREEDY))


@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_batch_prefix_when_a_row_joins_with_a_cached_prefix_then_same_tokens_as_cold(tiny_model_dir, variant):
    e = engine(tiny_model_dir, variant)
    prompt = e.text_prompt(TEXT)
    cold = drive(BatchDecoder(e, 2), {"x": (prompt, GREEDY)})["x"]
    bd = BatchDecoder(e, 2)
    drive(bd, {"x": (prompt, GREEDY)})
    other = e.text_prompt("a cat")
    together = drive(bd, {"x": (prompt, GREEDY), "y": (other, GREEDY)})  # x takes the row it left
    assert reuses(e, together["x"], len(prompt.ids) - 2) and tokens(together["x"]) == tokens(cold)
    follow = Prompt([*prompt.ids, *(t for t, _, _ in tokens(cold)), *e.tokenize(" more")])
    warm = drive(bd, {"x": (follow, GREEDY)})["x"]
    assert reuses(e, warm, len(prompt.ids) - 2)
    assert tokens(warm) == tokens(drive(BatchDecoder(e, 2), {"x": (follow, GREEDY)})["x"])


@pytest.mark.parametrize("forced", [True, False], ids=["passes-forced-inexact", "as-measured"])
@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_prefix_when_reused_in_whole_chunks_then_same_tokens_and_logprobs_as_cold(
    tiny_model_dir, variant, forced
):
    """Where passes depend on their size (ARM; or forced here, on any CPU, through the session's measured
    facts) a prefix is reused in whole prefill chunks, and the replies are still a cold prefill's bit for
    bit: a prompt again, another sharing part of it, and a follow-up after a decoded reply."""
    e = engine(tiny_model_dir, variant, prefill_chunk=4)
    sess = e.session()
    if forced:
        sess.__dict__["exactness"] = Exactness(one_position=False, passes=False)
    prompt = e.text_prompt(TEXT)
    n = len(prompt.ids)
    e.reset_cache()
    cold = generate(e, prompt, GREEDY)
    warm = generate(e, prompt, GREEDY)
    assert cached(cold) == 0 and reuses(e, warm, n - 2) and cached(warm) > 0
    assert tokens(warm) == tokens(cold)
    for keep in (n - 3, n // 2 + 1, 6):
        e.reset_cache()
        generate(e, Prompt([*prompt.ids[:keep], *e.tokenize(" zebra crossing")]), GREEDY)
        partly = generate(e, prompt, GREEDY)
        assert cached(partly) <= keep and reuses(e, partly, keep - 2) and tokens(partly) == tokens(cold), keep
    reply = [t for t, _, _ in tokens(cold)]
    follow = Prompt([*prompt.ids, *reply, *e.tokenize(" and so on")])
    warm = generate(e, follow, GREEDY)
    assert reuses(e, warm, n - 2) and cached(warm) <= n
    e.reset_cache()
    assert tokens(warm) == tokens(generate(e, follow, GREEDY))


@pytest.mark.parametrize("forced", [True, False], ids=["passes-forced-inexact", "as-measured"])
@pytest.mark.parametrize("variant", ["q4", "q4-a8"])
def test_batch_prefix_when_reused_in_whole_chunks_then_same_tokens_as_cold(tiny_model_dir, variant, forced):
    """The same in a batch: a row that joins with a cached prefix beside another reply, and a follow-up
    whose cached prefix holds the first reply's decoded keys (a batch pass's, never reused there)."""
    e = engine(tiny_model_dir, variant, prefill_chunk=4)
    if forced:
        e.session().__dict__["exactness"] = Exactness(one_position=False, passes=False)
    prompt = e.text_prompt(TEXT)
    n = len(prompt.ids)
    cold = drive(BatchDecoder(e, 2), {"x": (prompt, GREEDY)})["x"]
    bd = BatchDecoder(e, 2)
    drive(bd, {"x": (prompt, GREEDY)})
    together = drive(bd, {"x": (prompt, GREEDY), "y": (e.text_prompt("a cat"), GREEDY)})
    assert reuses(e, together["x"], n - 2) and cached(together["x"]) > 0
    assert tokens(together["x"]) == tokens(cold)
    follow = Prompt([*prompt.ids, *(t for t, _, _ in tokens(cold)), *e.tokenize(" more")])
    warm = drive(bd, {"x": (follow, GREEDY)})["x"]
    assert reuses(e, warm, n - 2) and cached(warm) <= n
    assert tokens(warm) == tokens(drive(BatchDecoder(e, 2), {"x": (follow, GREEDY)})["x"])


def test_prefix_when_one_position_passes_are_exact_then_reused_up_to_the_last_token(tiny_model_dir):
    """Where the session measures a one-position pass exact (or a foreign decoder, unmeasured), prefix
    reuse is as before: all but the last prompt token."""
    e = engine(tiny_model_dir, "q4-a8")
    prompt = e.text_prompt(TEXT)
    generate(e, prompt, GREEDY)
    exact = positions_exact(e.session())
    assert reuses(e, generate(e, prompt, GREEDY), len(prompt.ids) - (1 if exact else 2))


class PassSized:
    """A forward pass whose last logits carry the number of positions its pass had: `by_size` for every
    pass, as ARM's kernels sum rows differently by the pass's number of positions (by a few ulps);
    `one_alone` for passes of one position only, as x86's one-row kernels do; neither, as x86's
    multi-row kernels do."""

    def __init__(self, by_size: bool, one_alone: bool = False) -> None:
        self.by_size, self.one_alone = by_size, one_alone

    def __call__(self, ids, cache, past: int) -> np.ndarray:
        logits = np.zeros(8, np.float32)
        logits[int(ids[-1]) % 8] = 1.0
        if self.by_size or (self.one_alone and len(ids) == 1):
            logits[0] += np.float32(1e-7) * len(ids)
        return logits


@pytest.mark.parametrize(
    ("by_size", "one_alone", "one_position", "passes"),
    [
        (False, False, True, True),
        (False, True, False, True),  # x86: one-row kernels alone differ
        (True, False, False, False),  # ARM: every pass sums by its size
    ],
)
def test_exactness_when_passes_sum_by_their_size_then_probe_says_which(
    by_size, one_alone, one_position, passes
):
    measured = measure_exactness(PassSized(by_size, one_alone), lambda n: None, 8)
    assert (measured.one_position, measured.passes) == (one_position, passes)


class KeysBySize:
    """A forward pass that writes each position's key as a function of its pass's size, when that pass is
    `short`, but whose last logits do not show it: ARM's kernels on 74 + 2 positions against 76."""

    def __init__(self, short: int) -> None:
        self.short = short

    def __call__(self, ids, cache, past: int) -> np.ndarray:
        k, _v = cache.arrays[0]
        k[0, 0, past : past + len(ids), 0] = 1.0 + (1e-7 if len(ids) == self.short else 0.0)
        logits = np.zeros(8, np.float32)
        logits[int(ids[-1]) % 8] = 1.0
        return logits


class ArrayCache:
    def __init__(self, n: int) -> None:
        self.arrays = [(np.zeros((1, 1, n, 1), np.float32), np.zeros((1, 1, n, 1), np.float32))]


@pytest.mark.parametrize(("short", "passes"), [(0, True), (2, False)])
def test_exactness_when_only_the_keys_a_pass_wrote_differ_then_passes_not_exact(short, passes):
    assert measure_exactness(KeysBySize(short), ArrayCache, 8).passes is passes


@pytest.mark.parametrize(
    ("positions", "passes", "chunk", "reused"),
    [
        (True, True, 4, 9),  # all but the last prompt token
        (False, True, 4, 7),  # keys a cold prefill would write (7), two tokens left
        (True, False, 4, 4),  # passes depend on their size: whole chunks of those keys
        (False, False, 4, 4),
        (False, False, 8, 0),
        (False, False, 1, 7),
    ],
)
def test_reusable_prefix_table(positions, passes, chunk, reused):
    cache = Cache(12, exact=7)
    assert reusable_prefix(cache, list(range(10)), positions, passes, chunk) == reused


@pytest.mark.parametrize(
    ("pos", "n", "chunk", "one_position", "passes", "cold"),
    [
        (0, 10, 256, False, True, True),  # x86: any pass of several
        (10, 1, 256, False, True, False),  # ...but one position alone, where those differ
        (10, 1, 256, True, True, True),
        (0, 4, 4, False, False, True),  # ARM: a whole chunk from a multiple of it, as a cold prefill runs
        (8, 4, 4, False, False, True),
        (0, 10, 4, False, False, False),  # a pass longer than the chunk (another prefill_chunk)
        (2, 4, 4, False, False, False),  # a chunk not from a multiple of it (after a reused prefix)
        (8, 3, 4, False, False, False),  # a prompt's last, shorter pass: no longer prompt's
        (9, 1, 4, True, False, False),  # a decode step
    ],
)
def test_cold_pass_table(pos, n, chunk, one_position, passes, cold):
    assert cold_pass(pos, n, chunk, one_position, passes) is cold


# -- the pure parts, table by table ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pos", "total", "chunk", "exact", "end"),
    [
        (0, 10, 256, False, 10),  # the whole prompt in one pass
        (0, 1, 256, False, 1),  # one token: nothing else to do
        (0, 257, 256, False, 255),  # never one position left for a last pass
        (255, 257, 256, False, 257),
        (0, 257, 256, True, 256),  # exact one-position passes: plain chunks
        (0, 5, 2, False, 2),
        (2, 5, 2, False, 5),  # a chunk of two leaving one: takes it
        (9, 10, 4, False, 10),  # one position to go (a decode step)
        (0, 6, 4, False, 4),
        (0, 5, 4, False, 3),
    ],
)
def test_prefill_end_table(pos, total, chunk, exact, end):
    assert prefill_end(pos, total, chunk, exact) == end


class Cache:
    def __init__(self, tokens: int, exact: int) -> None:
        self.tokens, self.exact = list(range(tokens)), exact


@pytest.mark.parametrize(
    ("tokens", "exact", "pos", "n", "exact_pass", "after"),
    [
        (0, 0, 0, 10, True, 10),  # a cold prefill
        (10, 10, 10, 1, False, 10),  # a decode step: the prompt's keys stay exact
        (11, 10, 11, 1, False, 10),
        (12, 10, 12, 5, True, 10),  # a prefill after decoded keys: they are not a cold prefill's
        (12, 10, 8, 6, True, 14),  # ...unless it writes over them
        (20, 20, 5, 1, False, 5),  # rewriting position 5 alone: only 0..4 stay
        (20, 20, 0, 3, True, 3),  # a new prompt from 0 (another reply's keys after it are gone)
        (20, 3, 20, 2, True, 3),
    ],
)
def test_note_write_table(tokens, exact, pos, n, exact_pass, after):
    cache = Cache(tokens, exact)
    note_write(cache, pos, n, exact_pass)
    assert cache.exact == after
    cache.tokens = cache.tokens[:pos]
    assert exact_prefix(cache) == min(after, pos)


@pytest.mark.slow
def test_real_model_when_cold_or_warm_prefix_then_same_greedy_text_and_logprobs(smollm2_model_dir):
    """SmolLM2 q4-a8, where a one-position pass is 0.5 apart in the logits from a pass of several: a chat
    prompt cold, then warm (whole), partly warm (a prompt sharing its first 24 tokens), and a follow-up
    whose cached prefix holds the reply."""
    e = engine(smollm2_model_dir, "q4-a8", threads=2, context_length=512)
    prompt = e.chat_prompt([{"role": "user", "content": "Name three colours and say why the sky is blue."}])
    params = replace(GREEDY, max_tokens=24)
    e.reset_cache()
    cold = generate(e, prompt, params)
    warm = generate(e, prompt, params)
    e.reset_cache()
    generate(e, Prompt([*prompt.ids[:24], *e.tokenize("zebra")]), params)
    partly = generate(e, prompt, params)
    assert cached(warm) >= len(prompt.ids) - 2 and cached(partly) == 24
    assert tokens(warm) == tokens(cold) == tokens(partly)
    follow = Prompt(
        [*prompt.ids, *(t for t, _, _ in tokens(cold)), *e.tokenize(" And why is it red at dusk?")]
    )
    warm_follow = generate(e, follow, params)
    e.reset_cache()
    assert tokens(warm_follow) == tokens(generate(e, follow, params))
