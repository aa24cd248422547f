"""The `fast` variant through the real converter: installed when its measured KL is within the quality floor,
refused (files removed, the log and the manifest saying why) when it is not, never installed unmeasured, and
the nominal variant the fastest one installed; a default pull keeps the nominal variant alone, its weights
in one file."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.convert import nominal, pipeline
from models.convert.fast_plan import PLANS
from models.convert.nominal import check
from models.convert.pipeline import convert
from models.errors import VerificationFailed
from tests.tiny_gguf import TinySpec, write_tiny_gguf

# K-quant blocks hold 256 values: inputs must be multiples of 256; an untied head of its own type
SPEC = TinySpec(hidden=256, ffn=256, tied=False)
CONSTANT = 100.0


def constant_half_blocks(w: dict[str, np.ndarray]) -> None:
    """The head's columns 0-15 of every 32 hold one large value shared by every row (it shifts every logit
    alike, so the distribution does not see it), columns 16-31 the small random weights that decide it.
    Q6_K scales each 16 columns on its own and keeps both; any encoding with one scale per 32 columns or more
    rounds the deciding half to almost nothing. llama.cpp computes Q6_K exactly on the weight side."""
    head = w["output.weight"]
    cols = np.arange(head.shape[1])
    head[:, cols % 32 < 16] = CONSTANT


def tiny_gguf_file(tmp_path: Path, name: str, edit=None) -> Path:
    return write_tiny_gguf(
        tmp_path / f"{name}.gguf",
        matrix_type="Q4_1",
        embed_type="Q8_0",
        spec=SPEC,
        tensor_types={"output.weight": "Q6_K", "ffn_down.weight": "Q6_K"},
        edit=edit,
        name=name,
    )


def reencoding_plans_only(monkeypatch) -> None:
    """The plans that re-encode weights: the last one re-encodes nothing (q4-a8 with fp32 inputs to some
    matrices), and is within any floor q4-a8 comes near (test_..._then_the_fp32_inputs_plan_installed)."""
    monkeypatch.setattr(pipeline, "PLANS", tuple(p for p in PLANS if p.fp32_inputs == ()))


def test_convert_when_reencoded_variant_beyond_its_floor_then_refused_and_log_says_why(
    tmp_path, caplog, monkeypatch
):
    reencoding_plans_only(monkeypatch)
    gguf = tiny_gguf_file(tmp_path, "tiny-lossy", constant_half_blocks)
    out = tmp_path / "out"
    out.mkdir()
    said: list[str] = []
    with caplog.at_level(logging.WARNING, logger="simmer.convert"):
        frag = convert(gguf, out, threads=1, progress=lambda msg, _: said.append(msg))
    # a default pull: the candidates built, the nominal one kept (q4 when q4-a8 is not within the floor)
    assert "fast" not in frag["variants"] and frag["default_variant"] in ("q4-a8", "q4")
    why = frag["refused_variants"]["fast"]
    # every plan was tried, and each says how far it was
    assert why.startswith("not installed: 4-bit plan: KL mean") and "; 8-bit plan: KL mean" in why
    assert any(r.getMessage() == f"variant fast {why}" for r in caplog.records)
    # what a pull prints: each plan's verdict as it is measured, and the nominal variant with its reason
    assert any(m.startswith("fast (4-bit plan) not kept: KL mean") for m in said)
    assert any(m.startswith(f"nominal variant {frag['default_variant']}: ") for m in said)
    assert not (out / "fast.onnx").exists() and not (out / "fast.data").exists()
    # the floor it was held to, and how it was measured, are in the manifest
    floor = frag["quality_floor"]
    # llama.cpp's own KL where llama-cpp-python is installed, else the int8 reference's (arm64 has no
    # llama-cpp-python wheel), else the fixed fallback
    assert floor["source"] in ("llama.cpp", "int8 reference", "fallback")
    assert floor["kl_mean"] > 0 and floor["method"]


def accuracy_levels(onnx_file: Path) -> dict[str, int]:
    """Each MatMulNBits node's accuracy_level, by its codes' initializer."""
    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    levels: dict[str, int] = {}
    for node in (n for n in graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: a.i for a in node.attribute}
        levels[node.input[1]] = attrs["accuracy_level"]
    return levels


def test_convert_when_reencoding_plans_beyond_the_floor_then_the_keys_and_values_take_fp32_inputs(tmp_path):
    """The re-encoding plans are refused (the head's deciding half rounded away); the next plan, the GGUF's
    own blocks with fp32 activations into the key and value projections alone, is within the floor:
    installed as `fast`, sharing every weight with q4-a8, the fused projection cut in two nodes (the query's
    at accuracy level 4, the key's and value's at 1) and every other node at 4."""
    gguf = tiny_gguf_file(tmp_path, "tiny-lossy", constant_half_blocks)
    out = tmp_path / "out"
    out.mkdir()
    frag = convert(gguf, out, threads=1, variants=["q4-a8", "fast"])
    fast = frag["variants"]["fast"]
    verdicts = {a["plan"]: a["verdict"] for a in fast["attempts"]}
    assert verdicts["4-bit"].startswith("KL mean") and verdicts["8-bit"].startswith("KL mean")
    assert fast["plan"] == "fp32 inputs on attn_k/attn_v" and list(verdicts)[-1] == fast["plan"]
    assert check(fast["quality"], frag["quality_floor"]) is None
    assert not (out / "fast.data").exists() and fast["files"] == ["fast.onnx", "weights.data"]
    levels = accuracy_levels(out / "fast.onnx")
    fp32 = {name for name, level in levels.items() if level == 1}
    assert fp32 and all(".attn_qkv.1_3." in name for name in fp32)  # k and v: the fused run's last two
    assert all(level == 4 for name, level in levels.items() if name not in fp32)
    assert any(".attn_qkv.0_1." in name for name in levels)  # the query apart, at int8 inputs
    assert "fp32 activations" in fast["quant_map"]["Q4_1"]


def test_convert_when_keys_and_values_are_not_enough_then_the_wider_fp32_inputs_plan_installed(
    tmp_path, monkeypatch
):
    """Without the keys-and-values plan (as for a model it leaves beyond the floor), the widest plan
    is installed: fp32 activations into all of attention and ffn_down."""
    monkeypatch.setattr(pipeline, "PLANS", tuple(p for p in PLANS if p.fp32_inputs != ("attn_k", "attn_v")))
    gguf = tiny_gguf_file(tmp_path, "tiny-lossy", constant_half_blocks)
    out = tmp_path / "out"
    out.mkdir()
    frag = convert(gguf, out, threads=1, variants=["q4-a8", "fast"])
    fast = frag["variants"]["fast"]
    verdicts = {a["plan"]: a["verdict"] for a in fast["attempts"]}
    assert fast["plan"] == PLANS[-1].name and verdicts[PLANS[-1].name] == "within the floor"
    assert check(fast["quality"], frag["quality_floor"]) is None
    levels = accuracy_levels(out / "fast.onnx")
    fp32 = {name for name, level in levels.items() if level == 1}
    assert fp32 and all(level in (1, 4) for level in levels.values())
    assert all(".attn" in name for name in fp32)  # ffn_down is Q6_K here: 8-bit nodes keep int8 inputs
    assert any(".ffn" in name and level == 4 for name, level in levels.items())
    assert "fp32 activations" in fast["quant_map"]["Q4_1"]


def test_convert_when_reencoded_variant_within_its_floor_then_installed_in_the_one_weights_file(tmp_path):
    """On random weights every variant's KL is noise around llama.cpp's (int8 activations, either engine),
    so this one says where the floor is: well above that noise, as a model with headroom has it. Both
    candidates asked for by name: both kept, the re-encoded bytes moved into weights.data."""
    gguf = tiny_gguf_file(tmp_path, "tiny-fine")
    out = tmp_path / "out"
    out.mkdir()
    floor = {"source": "given", "kl_mean": 0.5, "kl_p99": 5.0}
    frag = convert(gguf, out, threads=1, floor=floor, variants=["q4-a8", "fast"])
    fast = frag["variants"]["fast"]
    assert fast["files"] == ["fast.onnx", "weights.data"] and not (out / "fast.data").exists()
    assert check(fast["quality"], frag["quality_floor"]) is None
    assert "re-encoded" in fast["quant_map"]["Q6_K"]
    assert fast["quality"]["positions"] > 200 and fast["quality"]["kl_p99"] >= fast["quality"]["kl_mean"]
    assert frag["refused_variants"] == {}
    chosen = nominal.choose(list(frag["variants"]), frag["variants"], frag["quality_floor"])
    assert (frag["default_variant"], frag["default_variant_reason"]) == chosen
    assert sorted(frag["variants"]["q4-a8"]["speed"]["raced_with"]) == ["fast"]


def test_convert_when_llama_cpp_absent_then_the_int8_reference_sets_the_floor_and_refuses(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    reencoding_plans_only(monkeypatch)
    gguf = tiny_gguf_file(tmp_path, "tiny-lossy", constant_half_blocks)
    out = tmp_path / "out"
    out.mkdir()
    frag = convert(gguf, out, threads=1, variants=["q4-a8", "fast"])
    floor = frag["quality_floor"]
    assert floor["source"] == "int8 reference" and floor["kl_mean"] > 0 and floor["kl_p99"] > 0
    assert "fast" not in frag["variants"]
    assert "(the int8 reference's, llama.cpp's arithmetic on this file)" in frag["refused_variants"]["fast"]


def test_convert_when_not_measured_then_reencoded_variant_never_installed(tmp_path):
    gguf = tiny_gguf_file(tmp_path, "tiny-unmeasured")
    out = tmp_path / "out"
    out.mkdir()
    frag = convert(gguf, out, threads=1, measure=False, variants=["q4-a8", "fast"])
    assert list(frag["variants"]) == ["q4-a8"]
    assert "no quality floor" in frag["refused_variants"]["fast"]
    with pytest.raises(VerificationFailed, match="no variant left"):
        convert(gguf, tmp_path / "empty", threads=1, measure=False, variants=["fast"])


@pytest.mark.parametrize(
    ("quality", "floor", "verdict"),
    [
        ({"kl_mean": 0.001, "kl_p99": 0.01}, {"source": "llama.cpp", "kl_mean": 0.002, "kl_p99": 0.02}, None),
        ({"kl_mean": 0.002, "kl_p99": 0.02}, {"source": "llama.cpp", "kl_mean": 0.002, "kl_p99": 0.02}, None),
        # either statistic over the floor refuses: a broad shift, or a tail
        (
            {"kl_mean": 0.003, "kl_p99": 0.01},
            {"source": "llama.cpp", "kl_mean": 0.002, "kl_p99": 0.02},
            "mean",
        ),
        (
            {"kl_mean": 0.001, "kl_p99": 0.03},
            {"source": "llama.cpp", "kl_mean": 0.002, "kl_p99": 0.02},
            "p99",
        ),
        (
            {"kl_mean": 0.001, "kl_p99": 0.001},
            {"source": "int8 reference", "kl_mean": 0.0005, "kl_p99": 0.1},
            "int8 reference",
        ),
        (None, {"source": "int8 reference", "kl_mean": 1.0, "kl_p99": 1.0}, "not measured"),
        ({"top1_agreement": 0.99}, {"source": "llama.cpp", "kl_mean": 1.0, "kl_p99": 1.0}, "not measured"),
    ],
)
def test_floor_check(quality, floor, verdict):
    got = check(quality, floor)
    assert (got is None) if verdict is None else (verdict in got)


def test_manifest_of_converted_folder_when_listed_then_every_variant_quality_visible(
    tmp_path, tiny_model_dir
):
    from models.variant_facts import describe, variant_facts

    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    facts = variant_facts(manifest)
    for name in manifest["variants"]:
        assert facts[name]["kl_mean"] is not None and facts[name]["top1_agreement"] is not None
        assert facts[name]["tokens_per_cpu_s"] and facts[name]["decode_tok_s"]
        assert "KL" in describe(name, facts[name]) and "tok/s" in describe(name, facts[name])
