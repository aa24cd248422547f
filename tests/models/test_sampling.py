"""The sampler: greedy, seeded draws, filters, penalties and logprobs, on small hand-made logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from models.errors import InvalidParameter
from models.runtime.sampling import Sampler, make_rng
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
