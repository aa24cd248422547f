"""studies/experiments/rows_probe.py on the tiny model."""

from __future__ import annotations

from studies.experiments.rows_probe import probe


def test_rows_probe_when_batched_then_rows_do_not_depend_on_the_batch(tiny_model_dir):
    """Rows of passes with two or more positions are bitwise equal whatever the number of rows, and a
    decode step padded to two rows gives exactly a verification pass's row (on q4-a8 only the one-row pass
    differs); q4's one-row steps agree with them up to summation order."""
    for variant in ("q4", "q4-a8"):
        res = probe(tiny_model_dir, variant, rounds=2, context=256)
        assert set(res["batch_vs_batch"].values()) == {0.0} and res["padded_vs_batch"] == 0.0
    q4 = probe(tiny_model_dir, "q4", rounds=2, context=256)
    assert max(r["max_abs"] for r in q4["one_vs_batch"].values()) < 1e-3
