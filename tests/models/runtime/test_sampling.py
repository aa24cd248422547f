"""The sampler: greedy, seeded draws, filters, penalties and logprobs, on small hand-made logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from models.errors import InvalidParameter
from models.runtime.sampling import (
    GREEDY_BELOW,
    LOGPROB_FLOOR,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    Sampler,
    _sanitized,
    greedy_index,
    make_rng,
)
from models.types import SamplingParams


def random_logits(seed: int, n: int = 49152) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 4).astype(np.float32)


def probs_logits(probs: list[float]) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def draws(params: SamplingParams, logits: np.ndarray, n: int, seed: int = 0) -> Counter:
    s = Sampler(params, make_rng(seed))
    return Counter(s.sample(logits, [])[0] for _ in range(n))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("seed", range(5))
def test_sample_when_temperature_zero_then_argmax(seed: int) -> None:
    logits = random_logits(seed)
    token, _, top = Sampler(SamplingParams(temperature=0.0), make_rng(None)).sample(logits, [5, 6])
    assert token == int(np.argmax(logits))
    assert top is None


def test_sample_when_same_seed_then_same_sequence_and_other_seed_differs() -> None:
    logits = random_logits(1) / 4  # flat enough that draws vary

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, top_p=0.95), make_rng(seed))
        history: list[int] = []
        for _ in range(40):
            history.append(s.sample(logits, history)[0])
        return history

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sample_when_top_k_one_then_greedy() -> None:
    for seed in range(5):
        logits = random_logits(seed)
        s = Sampler(SamplingParams(temperature=1.5, top_k=1), make_rng(seed))
        assert s.sample(logits, [])[0] == int(np.argmax(logits))


def test_sample_when_top_p_tiny_then_greedy() -> None:
    for seed in range(5):
        logits = random_logits(seed)
        s = Sampler(SamplingParams(temperature=1.5, top_p=1e-6), make_rng(seed))
        assert s.sample(logits, [])[0] == int(np.argmax(logits))


def test_sample_when_top_k_then_only_the_k_best_and_all_of_them() -> None:
    logits = random_logits(3, n=1000) / 8
    best3 = set(np.argsort(-logits)[:3].tolist())
    seen = draws(SamplingParams(temperature=2.0, top_k=3), logits, 300)
    assert set(seen) == best3


def test_sample_when_top_p_then_smallest_set_reaching_it() -> None:
    logits = probs_logits([0.05, 0.5, 0.15, 0.3])
    assert set(draws(SamplingParams(top_p=0.8), logits, 400)) == {1, 3}  # 0.5 + 0.3 reaches 0.8
    assert set(draws(SamplingParams(top_p=0.81), logits, 400)) == {1, 2, 3}


def test_sample_when_top_p_needs_many_tokens_then_grows_past_the_first_head() -> None:
    logits = np.zeros(5000, dtype=np.float32)  # uniform: top_p 0.5 keeps 2500 tokens
    seen = draws(SamplingParams(top_p=0.5), logits, 2000)
    assert len(seen) > 1000
    assert len(seen) <= 2501


def test_sample_when_min_p_then_tokens_below_fraction_of_max_never_drawn() -> None:
    logits = probs_logits([0.4, 0.3, 0.15, 0.1, 0.05])
    # Threshold 0.3 * 0.4 = 0.12: tokens 3 and 4 are out.
    assert set(draws(SamplingParams(min_p=0.3), logits, 500)) == {0, 1, 2}
    assert set(draws(SamplingParams(min_p=0.0), logits, 500)) == {0, 1, 2, 3, 4}


def test_sample_when_temperature_then_frequencies_follow_scaled_softmax() -> None:
    logits = probs_logits([0.1, 0.2, 0.3, 0.4])
    n = 20000
    seen = draws(SamplingParams(temperature=0.5), logits, n, seed=3)
    expected = np.exp(log_softmax(logits / 0.5))
    observed = np.array([seen[i] / n for i in range(4)])
    assert np.abs(observed - expected).max() < 0.015


def test_penalize_when_repetition_then_positive_divided_negative_multiplied() -> None:
    logits = np.array([2.0, -2.0, 3.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0), make_rng(0))
    out = s.penalize(logits, [0, 1, 1])  # all in the prompt: repetition covers the prompt too
    np.testing.assert_allclose(out, [1.0, -4.0, 3.0, -1.0])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 3.0, -1.0])  # the caller's array is untouched


def test_penalize_when_presence_and_frequency_then_generated_tokens_only() -> None:
    logits = np.zeros(5, dtype=np.float32)
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), make_rng(0))
    prompt = [0, 0, 1]
    np.testing.assert_array_equal(s.penalize(logits, prompt), np.zeros(5))  # the prompt is not penalised
    out = s.penalize(logits, [*prompt, 2, 2, 3, 0])
    # token 2 generated twice: 0.5 + 2 * 0.25; tokens 3 and 0 once: 0.5 + 0.25.
    np.testing.assert_allclose(out, [-0.75, 0.0, -1.0, -0.75, 0.0])


def test_penalize_when_prompt_len_given_then_it_marks_the_generated_part() -> None:
    s = Sampler(SamplingParams(frequency_penalty=1.0), make_rng(0), prompt_len=1)
    np.testing.assert_allclose(s.penalize(np.zeros(3, dtype=np.float32), [0, 1, 1]), [0.0, -2.0, 0.0])


def test_penalize_when_history_restarts_then_counts_restart() -> None:
    s = Sampler(SamplingParams(frequency_penalty=1.0), make_rng(0), prompt_len=0)
    s.penalize(np.zeros(3, dtype=np.float32), [1, 1, 1])
    np.testing.assert_allclose(s.penalize(np.zeros(3, dtype=np.float32), [2]), [0.0, 0.0, -1.0])


def test_sample_when_greedy_with_repetition_penalty_then_repeated_token_avoided() -> None:
    logits = np.array([5.0, 4.0, 1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.5), make_rng(0))
    assert s.sample(logits, [0])[0] == 1
    assert Sampler(SamplingParams(temperature=0.0), make_rng(0)).sample(logits, [0])[0] == 0


def test_logprobs_when_requested_then_raw_model_log_softmax_best_first() -> None:
    logits = random_logits(4, n=50)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.3, logprobs=5)
    token, logprob, top = Sampler(params, make_rng(0)).sample(logits, [1, 2, 3])
    expected = log_softmax(logits)
    # Under the model's distribution: neither the penalty nor the temperature changes it.
    assert logprob == pytest.approx(expected[token], abs=1e-5)
    assert top is not None and len(top) == 5
    assert [i for i, _ in top] == np.argsort(-expected)[:5].tolist()
    for i, lp in top:
        assert lp == pytest.approx(expected[i], abs=1e-5)


def test_logprobs_when_all_tokens_listed_then_they_sum_to_one() -> None:
    logits = random_logits(5, n=8)
    _, _, top = Sampler(SamplingParams(logprobs=8), make_rng(0)).sample(logits, [])
    assert top is not None
    assert sum(np.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_when_zero_then_chosen_only() -> None:
    logits = random_logits(6, n=20)
    token, logprob, top = Sampler(SamplingParams(temperature=0.0, logprobs=0), make_rng(0)).sample(logits, [])
    assert top == ()
    assert logprob == pytest.approx(log_softmax(logits)[token], abs=1e-5)


def test_sample_when_sampling_then_caller_logits_unchanged() -> None:
    logits = random_logits(7, n=1000)
    before = logits.copy()
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=1.0)
    s = Sampler(params, make_rng(0))
    s.sample(logits, [1, 2])
    s.sample(logits, [1, 2, 3])
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 5e-324),
        ("repetition_penalty", 0.009),
        ("repetition_penalty", 100.5),
        ("temperature", float("nan")),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
    ],
)
def test_sampler_when_parameter_out_of_range_then_invalid_parameter_names_it(
    field: str, value: float
) -> None:
    with pytest.raises(InvalidParameter) as err:
        Sampler(SamplingParams(**{field: value}), make_rng(0))
    assert err.value.param == field


def test_validate_when_repetition_penalty_absurd_then_invalid_parameter() -> None:
    from models.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="repetition_penalty"):
        Sampler(SamplingParams(repetition_penalty=1e308), make_rng(0))


# ---- totality: every accepted value, any logits -------------------------------------------------------


# Logits as a broken or extreme model could produce them: NaN, +-inf, float32's largest, subnormals.
any_logits = hnp.arrays(
    np.float32,
    st.integers(1, 64),
    elements=st.floats(width=32) | st.sampled_from([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0]),
)
# Each field over its whole accepted range, boundaries and subnormals included.
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
tiny_floats = st.sampled_from([0.0, 5e-324, 1e-300, 1e-40, 1e-6, GREEDY_BELOW])


@st.composite
def params_and_logits(draw) -> tuple[SamplingParams, np.ndarray, list[int]]:
    logits = draw(any_logits)
    n = logits.shape[0]
    ids = st.integers(0, n - 1)
    params = SamplingParams(
        temperature=draw(st.floats(0.0, 2.0) | tiny_floats),
        top_p=draw(st.floats(0.0, 1.0) | tiny_floats),
        top_k=draw(st.integers(0, 2 * n) | st.just(2**70)),
        min_p=draw(st.floats(0.0, 1.0) | tiny_floats),
        repetition_penalty=draw(
            st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
            | st.sampled_from([MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 1.0])
        ),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        seed=draw(st.none() | st.integers(SEED_MIN, SEED_MAX)),
        logprobs=draw(st.none() | st.integers(0, MAX_TOP_LOGPROBS)),
        logit_bias=tuple(draw(st.dictionaries(ids, st.floats(-100.0, 100.0), max_size=8)).items()),
    )
    history = draw(st.lists(ids, max_size=12))
    return params, logits, history


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params_and_logits(), st.integers(1, 4))
def test_sample_when_any_accepted_params_and_any_logits_then_valid_token_and_finite_logprobs(
    case: tuple[SamplingParams, np.ndarray, list[int]], steps: int
) -> None:
    params, logits, history = case
    n = logits.shape[0]
    before = logits.copy()
    s = Sampler(params, make_rng(params.seed), prompt_len=min(len(history), 3))
    history = list(history)
    for _ in range(steps):
        token, logprob, top = s.sample(logits, history)
        assert 0 <= token < n
        if params.logprobs is None:
            assert logprob is None and top is None
        else:
            assert logprob is not None and LOGPROB_FLOOR <= logprob <= 0.0 + 1e-6
            assert top is not None and len(top) == min(params.logprobs, n)
            assert all(0 <= i < n and LOGPROB_FLOOR <= lp <= 1e-6 for i, lp in top)
        history.append(token)
    np.testing.assert_array_equal(logits, before)  # NaN compares equal here: the input is untouched


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(2, 64), elements=finite32, unique=True),
    st.floats(0.0, GREEDY_BELOW, exclude_max=True) | tiny_floats.filter(lambda t: t < GREEDY_BELOW),
    st.integers(SEED_MIN, SEED_MAX),
)
def test_sample_when_temperature_tiny_then_greedy(logits: np.ndarray, temperature: float, seed: int) -> None:
    token, _, _ = Sampler(SamplingParams(temperature=temperature), make_rng(seed)).sample(logits, [])
    assert token == int(np.argmax(logits))


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, GREEDY_BELOW, 2.0])
@pytest.mark.parametrize("penalty", [5e-324, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_sample_when_issue_11_values_then_valid_token_or_invalid_parameter(
    temperature: float, penalty: float
) -> None:
    """The campaign's reproductions: temperature 1e-40 and repeat_penalty 5e-324 gave an IndexError."""
    logits = random_logits(9, n=500) * 1e37  # logits / 0.01 overflow float32
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, min_p=0.05)
    if penalty < MIN_REPETITION_PENALTY:
        with pytest.raises(InvalidParameter) as err:
            Sampler(params, make_rng(0))
        assert err.value.param == "repetition_penalty"
        return
    s = Sampler(params, make_rng(0))
    history = [int(np.argmax(logits))]
    for _ in range(20):
        token = s.sample(logits, history)[0]
        assert 0 <= token < 500
        history.append(token)


def test_sample_when_logits_nan_then_never_chosen_and_plus_inf_share_the_mass() -> None:
    logits = np.array([np.nan, 1.0, np.inf, 0.0, np.inf, np.nan], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0), make_rng(0)).sample(logits, [])[0] == 2
    assert set(draws(SamplingParams(temperature=1.0), logits, 200)) == {2, 4}
    all_bad = np.array([np.nan, -np.inf, -np.inf], dtype=np.float32)
    assert set(draws(SamplingParams(temperature=1.0), all_bad, 200)) == {0, 1, 2}


# ---- seed -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 0, -12345])
def test_make_rng_when_any_int64_seed_then_reproducible(seed: int) -> None:
    logits = random_logits(1) / 4

    def run() -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), make_rng(seed))
        return [s.sample(logits, [])[0] for _ in range(20)]

    assert run() == run()


def test_make_rng_when_negative_seed_then_not_the_same_stream_as_its_absolute_value() -> None:
    a, b = make_rng(-1).random(4), make_rng(1).random(4)
    assert not np.array_equal(a, b)


# ---- logit_bias -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_sample_when_logit_bias_minus_100_then_token_banned_and_plus_100_forced(temperature: float) -> None:
    logits = random_logits(11, n=2000)  # std 4: a real model's spread
    best = int(np.argmax(logits))
    worst = int(np.argmin(logits))
    banned = Sampler(SamplingParams(temperature=temperature, logit_bias=((best, -100.0),)), make_rng(0))
    forced = Sampler(SamplingParams(temperature=temperature, logit_bias=((worst, 100.0),)), make_rng(0))
    for _ in range(50):
        assert banned.sample(logits, [])[0] != best
        assert forced.sample(logits, [])[0] == worst


def test_sample_when_small_logit_bias_then_added_to_the_logit() -> None:
    logits = probs_logits([0.5, 0.5])
    n = 4000
    seen = draws(SamplingParams(temperature=1.0, logit_bias=((1, float(np.log(3.0))),)), logits, n, seed=5)
    assert seen[1] / n == pytest.approx(0.75, abs=0.03)  # odds 1:3 (0.03 is over 4 standard deviations)


def test_logprobs_when_logit_bias_then_still_the_raw_model_distribution() -> None:
    logits = random_logits(12, n=30)
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias=((0, 100.0),))
    token, logprob, _ = Sampler(params, make_rng(0)).sample(logits, [])
    assert token == 0
    assert logprob == pytest.approx(max(log_softmax(logits)[0], LOGPROB_FLOOR), abs=1e-5)


@pytest.mark.parametrize(("bias", "vocab"), [(((5, 101.0),), None), (((-1, 1.0),), None), (((10, 1.0),), 10)])
def test_validate_when_logit_bias_out_of_range_then_invalid_parameter(bias, vocab) -> None:
    with pytest.raises(InvalidParameter) as err:
        Sampler(SamplingParams(logit_bias=bias), make_rng(0), vocab_size=vocab)
    assert err.value.param == "logit_bias"


def test_sample_when_logit_bias_id_beyond_logits_then_invalid_parameter() -> None:
    s = Sampler(SamplingParams(logit_bias=((10, 1.0),)), make_rng(0))
    with pytest.raises(InvalidParameter, match="logit_bias"):
        s.sample(np.zeros(10, dtype=np.float32), [])


def test_settings_sampling_defaults_when_at_their_bounds_then_sampler_accepts_them() -> None:
    """SIMMER_TEMPERATURE and friends accept exactly what the sampler handles."""
    from server.settings import Settings

    for name in ("temperature", "top_p", "top_k", "min_p"):
        field = Settings.model_fields[name]
        bounds = {type(m).__name__: m for m in field.metadata}
        low = getattr(bounds.get("Ge"), "ge", None)
        if low is None:
            low = np.nextafter(bounds["Gt"].gt, 1.0)
        high = getattr(bounds.get("Le"), "le", 10**6)
        for value in (low, high):
            validate_one = SamplingParams(**{name: value})
            Sampler(validate_one, make_rng(0)).sample(random_logits(0, n=50), [])


# ---- a constraint's mask (structured output, tool calls) -------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.5, top_k=2, seed=2),
        SamplingParams(temperature=0.7, top_p=0.3, seed=3),
        SamplingParams(temperature=1.0, min_p=0.9, seed=4),
        SamplingParams(temperature=1.0, logit_bias=((1, -100.0), (5, 100.0)), seed=5),
        SamplingParams(temperature=1.0, repetition_penalty=100.0, frequency_penalty=2.0, seed=6),
    ],
)
@pytest.mark.parametrize(
    "logits",
    [
        np.array([0, 1, 2, 3, 4, 50, 6, 7], dtype=np.float32),
        np.array([np.nan, np.nan, 1, np.inf, np.inf, np.inf, np.nan, 0], dtype=np.float32),
        np.array([-np.inf] * 8, dtype=np.float32),
        np.array([np.inf, -np.inf, np.nan, 3e38, -3e38, np.inf, 0, 1], dtype=np.float32),
    ],
)
def test_sample_when_mask_then_only_allowed_tokens_under_every_setting(params, logits) -> None:
    allowed = np.zeros(8, dtype=bool)
    allowed[[1, 2, 7]] = True
    sampler = Sampler(params, make_rng(params.seed), prompt_len=1)
    history = [3]
    for _ in range(30):
        token, _, _ = sampler.sample(logits, history, allowed)
        assert allowed[token]
        history.append(token)


def test_sample_when_mask_then_logprobs_are_the_models_unmasked() -> None:
    logits = np.array([5.0, 1.0, 0.0, -1.0], dtype=np.float32)
    allowed = np.array([False, False, True, True])
    masked = Sampler(SamplingParams(temperature=0.0, logprobs=2), make_rng(0)).sample(logits, [0], allowed)
    free = Sampler(SamplingParams(temperature=0.0, logprobs=2), make_rng(0)).sample(logits, [0])
    assert masked[0] == 2 and free[0] == 0
    assert masked[2] == free[2]  # the top alternatives: the model's own (token 0 first)
    assert masked[1] == pytest.approx(float(logits[2] - np.log(np.exp(logits).sum())), abs=1e-5)


# ---- greedy in one pass --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(any_logits)
def test_greedy_index_when_any_logits_then_argmax_of_the_sanitized_logits(logits: np.ndarray) -> None:
    """The one-pass greedy pick equals the two-pass one (argmax after _sanitized) on any logits: NaN,
    +-inf, all -inf, ties (the first wins in both)."""
    assert greedy_index(logits) == int(np.argmax(_sanitized(logits)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params_and_logits(), st.booleans(), st.integers(0, 2**32 - 1))
def test_sample_when_greedy_then_same_token_as_argmax_of_sanitized_pipeline(
    case: tuple[SamplingParams, np.ndarray, list[int]], masked: bool, mask_seed: int
) -> None:
    """Greedy with logit_bias, penalties and a mask: the token is the argmax of the penalized, masked,
    sanitized logits, as before the one-pass pick."""
    params, logits, history = case
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
    )
    allowed = None
    if masked:
        allowed = np.random.default_rng(mask_seed).random(logits.shape[0]) < 0.5
        allowed[mask_seed % logits.shape[0]] = True
    s, ref = (Sampler(params, make_rng(0), prompt_len=1) for _ in range(2))
    token, _, _ = s.sample(logits, history, allowed)
    with np.errstate(over="ignore", invalid="ignore"):  # as inside sample(): overflow lands on inf
        ids, x = ref._masked(logits, history, allowed)
    expected = int(np.argmax(x))
    assert token == (expected if ids is None else int(ids[expected]))
    assert s.distribution(logits, history, allowed)[0].tolist() == [token]
