"""bench/kl.py's comparison: KL(reference || engine) of softmaxes, as llama-perplexity --kl-divergence."""

from __future__ import annotations

import math

import numpy as np

from bench.kl import compare


def test_compare_when_same_distribution_then_zero_even_if_logits_shifted() -> None:
    ref = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    got = compare(ref, ref + 3.0)  # softmax ignores a constant
    assert got["kl_mean"] == 0.0 and got["top1_agreement"] == 1.0 and got["positions"] == 5


def test_compare_when_two_tokens_then_the_closed_form() -> None:
    p, q = 0.9, 0.6
    ref = np.log(np.array([[p, 1 - p]]))
    got = compare(ref, np.log(np.array([[q, 1 - q]])))
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert math.isclose(got["kl_mean"], round(expected, 6)) and got["top1_agreement"] == 1.0


def test_compare_when_argmax_differs_then_agreement_counts_positions() -> None:
    ref = np.array([[2.0, 0.0], [0.0, 2.0]])
    got = compare(ref, np.array([[2.0, 0.0], [2.0, 0.0]]))
    assert got["top1_agreement"] == 0.5 and got["kl_mean"] > 0
