"""bench/cpu_cost/cut.py: a decode graph cut into one-node graphs by kind, and the per-operator arithmetic.

Natively, on the tiny model, no qemu (the counted run: `simmer bench cpu-cost --by-op`, docs/cpu-classes.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.cpu_cost.cut import (
    OVERHEAD,
    WHOLE,
    by_op,
    capture,
    decode_feed,
    kinds,
    one_node,
    optimized,
    per_call,
    write_plan,
)


def test_per_call_when_markers_then_last_n_over_n_net_of_the_empty_run() -> None:
    entries = [{"label": OVERHEAD}, {"label": "MatMulNBits attn_qkv"}, {"label": WHOLE}]
    # per entry: after a warm run, after N runs, after N more; the whole step with its own N
    marks = [0, 40, 80, 100, 1100, 2080, 3000, 7000, 11000]
    got = per_call(marks, [4, 4, 2], entries)
    assert [g["insns_per_call_raw"] for g in got] == [10, 245, 2000]
    assert [g["insns_per_call"] for g in got] == [0, 235, 1990]
    assert got[1]["insns_per_call_first_half"] == 250


def test_per_call_when_markers_missing_then_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        per_call([1, 2], [4], [{"label": OVERHEAD}])


def test_by_op_when_kinds_then_per_token_share_and_coverage() -> None:
    def entry(label: str, calls: int, raw: int, net: int) -> dict[str, object]:
        return {
            "label": label,
            "key": label,
            "calls_per_token": calls,
            "insns_per_call_raw": raw,
            "insns_per_call": net,
            "insns_per_call_first_half": raw + 5,
        }

    measured = [
        entry(OVERHEAD, 0, 10, 0),
        entry("a", 30, 30, 20),
        entry("b", 1, 210, 200),
        entry(WHOLE, 1, 1000, 990),
    ]
    got = by_op(measured)
    assert [o["op"] for o in got["ops"]] == ["a", "b"]  # most instructions per token first
    assert [o["insns_per_token"] for o in got["ops"]] == [600, 200]
    assert [o["share_of_step"] for o in got["ops"]] == [0.6, 0.2]
    assert [o["insns_per_call_first_half_raw"] for o in got["ops"]] == [35, 215]
    assert got["coverage"] == 0.8 and got["whole_step_insns"] == 1000 and got["run_overhead_insns"] == 10


@pytest.fixture(scope="module")
def tiny_cut(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    onnx_path = (
        tiny_model_dir / json.loads((tiny_model_dir / "manifest.json").read_text())["variants"]["q4"]["file"]
    )
    tmp = tmp_path_factory.mktemp("cut")
    model = optimized(onnx_path, tmp)
    values = capture(model, decode_feed(model, past=5), tmp)
    return model, values


def test_kinds_when_tiny_decode_graph_then_every_node_once_and_layers_share_kinds(tiny_cut) -> None:
    model, values = tiny_cut
    found = kinds(model, values)
    named = [n for k in found for n in k.nodes]
    assert len(named) == len(model.graph.node) == len(set(named))
    n_layers = sum(1 for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert n_layers >= 2
    by_label = {k.label: k for k in found}
    assert len(by_label["MatMulNBits attn_qkv"].nodes) == n_layers  # one kind for every layer's matrix
    assert len(by_label["GroupQueryAttention rope"].nodes) == n_layers


def test_one_node_when_run_alone_then_gives_what_the_node_gave_in_the_whole_step(tiny_cut) -> None:
    import onnxruntime as ort

    model, values = tiny_cut
    for kind in kinds(model, values):
        cut, feed = one_node(model, kind.nodes[0], values)
        sess = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
        outs = sess.run(None, feed)
        for out, got in zip(sess.get_outputs(), outs, strict=True):
            np.testing.assert_allclose(
                np.asarray(got), values[out.name], rtol=1e-5, atol=1e-5, err_msg=kind.label
            )


def test_write_plan_when_tiny_model_then_op_guest_runs_every_entry_natively(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import onnx

    from bench.cpu_cost import guest
    from bench.cpu_cost.op_guest import main

    onnx_path = (
        tiny_model_dir / json.loads((tiny_model_dir / "manifest.json").read_text())["variants"]["q4"]["file"]
    )
    plan = write_plan(onnx_path, tmp_path / "plan", past=5)
    entries = json.loads(plan.read_text())["entries"]
    assert entries[0]["label"] == OVERHEAD and entries[-1]["label"] == WHOLE
    before = len(guest.TIMES)
    main(["--plan", str(plan), "--calls", "2", "--whole-calls", "1"])
    marks = guest.TIMES[before:]
    calls = [1 if e["label"] == WHOLE else 2 for e in entries]
    got = by_op(per_call(marks, calls, entries))  # natively the markers' times stand in for counts
    assert {o["op"] for o in got["ops"]} >= {"MatMulNBits attn_qkv", "GroupQueryAttention rope"}
    whole = onnx.load(str(plan.parent / f"{entries[-1]['file']}.onnx"), load_external_data=False)
    assert sum(o["calls_per_token"] for o in got["ops"]) == len(whole.graph.node)  # every node has a kind
