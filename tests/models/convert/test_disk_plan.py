"""The converter's disk plan against what it really writes: the weights and the graphs exactly, the rest
bounded from above."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.convert.disk_plan import WEIGHTS_FILE, estimate_output
from models.convert.model import GGUFModel
from models.convert.pipeline import WEIGHTS_FILE as PIPELINE_WEIGHTS_FILE
from models.convert.pipeline import convert, plan_variants
from tests.tiny_gguf import TinySpec, write_tiny_gguf

K = TinySpec(hidden=256, ffn=256)  # K-quant blocks hold 256 values
SOURCES = {  # name: write_tiny_gguf arguments
    "Q4_1+Q8_0 table": {"matrix_type": "Q4_1", "embed_type": "Q8_0"},  # SmolLM2's layout
    "Q8_0": {"matrix_type": "Q8_0"},
    "Q4_0+F32 table": {"matrix_type": "Q4_0", "embed_type": "F32"},
    "F16 untied": {"matrix_type": "F16", "spec": TinySpec(tied=False)},  # f32 + q8 + q4-a8
    "F32": {"matrix_type": "F32"},
    # Gemma 3's Q4_K_M mix (a Q8_0 v among Q5_0 q/k: fused runs, a Q6_K down at block 16), its own layout
    "gemma3 Q4_K_M": {
        "family": "gemma3",
        "matrix_type": "Q5_0",
        "embed_type": "Q8_0",
        "spec": TinySpec(hidden=256, ffn=256, n_layers=6, n_kv_heads=1, head_dim=64, sliding_window=8),
        "tensor_types": {
            "blk.0.attn_v.weight": "Q8_0",
            "attn_output.weight": "Q4_K",
            "ffn_down.weight": "Q6_K",
        },
    },
    # Qwen 2's QKV bias over mixed layouts (Q4_K q/k, Q6_K v), an untied Q6_K head
    "qwen2 Q4_K_M": {
        "family": "qwen2",
        "matrix_type": "Q4_K",
        "embed_type": "Q4_K",
        "spec": TinySpec(hidden=256, ffn=256, tied=False),
        "tensor_types": {"attn_v.weight": "Q6_K", "output.weight": "Q6_K"},
    },
    "llama3 Q5_1 table + Q2_K/Q3_K": {
        "family": "llama3",
        "matrix_type": "Q3_K",
        "embed_type": "Q5_1",
        "spec": K,
        "tensor_types": {"ffn_gate.weight": "Q2_K"},
    },
}


def _sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def _check(plan: dict[str, int], actual: dict[str, int]) -> None:
    """weights.data and the .onnx files are built by the same code as the converter's, dry: exact. The
    tokenizer and the small files are bounds."""
    for name, size in actual.items():
        if name.startswith("fast."):  # built plan by plan until one is kept: the largest plan bounds it
            assert size <= plan[name], name
        elif name == WEIGHTS_FILE or name.endswith(".onnx"):
            assert plan[name] == size, name
        elif name.startswith("tokenizer.") and name != "tokenizer_config.json":  # .json, .bpe.npz, .spm.npz
            assert size <= plan[name], name
    small = sum(s for n, s in actual.items() if n not in plan)
    assert small <= plan["small files"]
    assert set(plan) - {"small files", "fast.onnx", "fast.data"} <= set(actual)  # fast: unless refused


@pytest.mark.parametrize("source", list(SOURCES))
def test_plan_when_converted_then_weights_and_graphs_exact(tmp_path, source) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", seed=1, **SOURCES[source])
    seen: list[dict[str, int]] = []
    out = tmp_path / "out"
    out.mkdir()
    convert(gguf, out, measure=False, disk_plan=seen.append)
    assert len(seen) == 1
    _check(seen[0], _sizes(out))


def test_plan_when_every_variant_then_exact_too(tmp_path) -> None:
    """Variants the plan does not choose by default (f32 and q8 of a quantized source) share bytes with
    the others in their own way."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", seed=1, matrix_type="Q4_K", embed_type="Q6_K", spec=K)
    names = ["f32", "q8", "q4", "q4-a8"]
    out = tmp_path / "out"
    out.mkdir()
    convert(gguf, out, measure=False, variants=names)
    _check(estimate_output(GGUFModel(gguf), names), _sizes(out))


def test_plan_when_some_variants_then_only_theirs(tmp_path, tiny_gguf) -> None:
    model = GGUFModel(tiny_gguf)
    every = estimate_output(model, plan_variants(model))
    # q4-a8's layers are q4's (the same Q4_1 blocks, the same names): alone, it lacks only q4's head
    only_a8 = estimate_output(model, ["q4-a8"])
    assert set(only_a8) == {WEIGHTS_FILE, "tokenizer.json", "tokenizer.bpe.npz", "small files", "q4-a8.onnx"}
    assert only_a8[WEIGHTS_FILE] < every[WEIGHTS_FILE]
    out = tmp_path / "out"
    out.mkdir()
    convert(tiny_gguf, out, variants=["q4-a8"], measure=False)
    _check(only_a8, _sizes(out))


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
    manifest = json.loads((smollm2_model_dir / "manifest.json").read_text())
    plan = estimate_output(model, list(manifest["variants"]))
    actual = {n: s for n, s in _sizes(smollm2_model_dir).items() if n != "manifest.json"}
    _check(plan, actual)
    assert sum(actual.values()) <= sum(plan.values()) <= sum(actual.values()) * 1.01


def test_plan_when_fp16_kv_then_exact_with_its_rope_caches(tmp_path, tiny_gguf) -> None:
    seen: list[dict[str, int]] = []
    out = tmp_path / "out"
    out.mkdir()
    convert(
        tiny_gguf, out, variants=["q4", "q4-a8"], measure=False, disk_plan=seen.append, kv_dtype="float16"
    )
    _check(seen[0], _sizes(out))
    assert seen[0][WEIGHTS_FILE] > estimate_output(GGUFModel(tiny_gguf), ["q4", "q4-a8"])[WEIGHTS_FILE]
