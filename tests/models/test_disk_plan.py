"""The converter's disk plan against what it really writes: never less, and close."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.convert.disk_plan import WEIGHTS_FILE, estimate_output
from models.convert.pipeline import WEIGHTS_FILE as PIPELINE_WEIGHTS_FILE
from models.convert.pipeline import convert, plan_variants
from models.gguf.reader import GGUFModel
from tests.tiny_gguf import TinySpec, write_tiny_gguf

SOURCES = [  # (matrix type, embedding type, tied)
    ("Q4_1", "Q8_0", True),  # SmolLM2's layout
    ("Q8_0", None, True),  # plans a q8 variant too
    ("Q4_0", "F32", True),
    ("F16", None, False),  # an untied head
    ("F32", None, True),
]


def _sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def _check(plan: dict[str, int], actual: dict[str, int]) -> None:
    """weights.data is planned from the same names and shapes as the builder: exact. The .onnx files and
    the tokenizer are bounds. Together: at least what is written, at most a little more."""
    assert plan[WEIGHTS_FILE] == actual[WEIGHTS_FILE]
    for name, size in actual.items():
        if name.endswith(".onnx") or name == "tokenizer.json":
            assert size <= plan[name], name
    small = sum(s for n, s in actual.items() if n not in plan)
    assert small <= plan["small files"]
    assert set(plan) - {"small files"} <= set(actual)


@pytest.mark.parametrize(("mtype", "etype", "tied"), SOURCES)
def test_plan_when_converted_then_never_below_what_was_written(tmp_path, mtype, etype, tied) -> None:
    gguf = write_tiny_gguf(
        tmp_path / "m.gguf", matrix_type=mtype, embed_type=etype, spec=TinySpec(tied=tied), seed=1
    )
    seen: list[dict[str, int]] = []
    out = tmp_path / "out"
    out.mkdir()
    convert(gguf, out, measure=False, disk_plan=seen.append)
    assert len(seen) == 1
    _check(seen[0], _sizes(out))


def test_plan_when_some_variants_then_only_theirs(tmp_path, tiny_gguf) -> None:
    model = GGUFModel(tiny_gguf)
    every = estimate_output(model, plan_variants(model))
    only_q4 = estimate_output(model, ["q4"])
    assert set(only_q4) == {WEIGHTS_FILE, "tokenizer.json", "small files", "q4.onnx"}
    assert only_q4[WEIGHTS_FILE] < every[WEIGHTS_FILE]
    out = tmp_path / "out"
    out.mkdir()
    convert(tiny_gguf, out, variants=["q4"], measure=False)
    _check(only_q4, _sizes(out))


def test_plan_when_converter_plans_then_called_before_any_write(tmp_path, tiny_gguf) -> None:
    out = tmp_path / "out"
    out.mkdir()

    def refuse(plan: dict[str, int]) -> None:
        assert not any(out.iterdir()), "the plan must come before the first write"
        raise RuntimeError("no room")

    with pytest.raises(RuntimeError, match="no room"):
        convert(tiny_gguf, out, measure=False, disk_plan=refuse)
    assert not any(out.iterdir())


def test_weights_file_name_when_planned_then_the_pipelines() -> None:
    assert WEIGHTS_FILE == PIPELINE_WEIGHTS_FILE


@pytest.mark.slow
def test_plan_when_smollm2_then_exact_weights_and_within_one_percent(smollm2_gguf, smollm2_model_dir) -> None:
    model = GGUFModel(smollm2_gguf)
    plan = estimate_output(model, plan_variants(model))
    actual = {n: s for n, s in _sizes(smollm2_model_dir).items() if n != "manifest.json"}
    _check(plan, actual)
    assert sum(actual.values()) <= sum(plan.values()) <= sum(actual.values()) * 1.01
