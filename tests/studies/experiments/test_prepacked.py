"""studies/experiments/prepacked.py on the tiny model."""

from __future__ import annotations

import pytest

from studies.experiments.prepacked import MODES, run


@pytest.mark.slow  # seven processes, each loading the model
def test_prepacked_when_written_once_then_same_logits_and_onnxruntime_checks_the_file(
    tiny_model_dir, tmp_path
):
    """The file written once holds MatMulNBits' packed buffers; every simmer load gives the same tokens and
    first logits; and onnxruntime refuses the file once a packed byte changes, which is why loading it
    does not save the packing (what docs/performance.md reports)."""
    report = run(tiny_model_dir, None, "q4-a8", rounds=1, threads=1, work=tmp_path, modes=MODES)
    assert report["written_once"]["packed_bytes"]["MatMulNBits"] > 0
    assert set(report["results"]) == {f"simmer:{m}" for m in MODES}
    assert report["same_tokens_and_logits"] is True
    assert "ValidatePrePackedWeights" in report["validation"]["one_packed_byte_changed"]
