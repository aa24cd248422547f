"""The projections of a real GGUF through convert/linear.py, one standalone graph per projection and variant:
how close each is to x @ W^T in float64 over GGML's dequantized weights, and its time per call at one token
(decode) and at 256 (prefill), rounds interleaved.

    python -m bench.experiments.gguf_linears GGUF [--layers 0 2] [--threads 2] [--rounds 5]
    python -m bench.experiments.gguf_linears GGUF --memory
        # every layer's projections in one graph per variant: resident memory after loading, after a run

Made for Gemma 3 270M's Q4_K_M file (Q5_0 / Q8_0 / Q4_K / Q6_K projections) before its architecture was
supported: only the tensors are read.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from bench.experiments.table_memory import GGUFTensors
from models.convert.graph import OPSET, VARIANTS, GraphBuilder, WeightFile
from models.convert.linear import MS, linear
from models.runtime.session import session_options

PROJECTIONS = {  # key: tensors fused into one projection
    "attn_qkv": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
    "attn_output": ["attn_output.weight"],
    "ffn_gate_up": ["ffn_gate.weight", "ffn_up.weight"],
    "ffn_down": ["ffn_down.weight"],
}


def build(model: GGUFTensors, variant: str, layer: int, proj: str, weights: WeightFile, out: Path) -> Path:
    g = GraphBuilder(model, VARIANTS[variant], weights)
    names = [f"blk.{layer}.{n}" for n in PROJECTIONS[proj]]
    k = model.tensor(names[0]).cols
    n = sum(model.tensor(x).rows for x in names)
    y, _ = linear(g, "x", f"blk.{layer}.{proj}", names)
    graph = helper.make_graph(
        g.nodes,
        proj,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", n])],
        list(g.inits.values()),
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    path = out / f"{variant}-{layer}-{proj}.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def all_layers(model: GGUFTensors, variant: str, weights: WeightFile, out: Path) -> Path:
    """Every projection of every layer in one graph, each fed by an input of its width."""
    g = GraphBuilder(model, VARIANTS[variant], weights)
    widths, outs = set(), []
    layers = sorted({int(n.split(".")[1]) for n in model.tensors if n.startswith("blk.")})
    for layer in layers:
        for proj, parts in PROJECTIONS.items():
            names = [f"blk.{layer}.{p}" for p in parts]
            k = model.tensor(names[0]).cols
            widths.add(k)
            outs.append(linear(g, f"x{k}", f"blk.{layer}.{proj}", names)[0])
    graph = helper.make_graph(
        g.nodes,
        "layers",
        [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in sorted(widths)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        list(g.inits.values()),
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    path = out / f"layers-{variant}.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def probe_memory(path: Path, threads: int) -> dict:
    import psutil

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    sess = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
    rss1 = proc.memory_info().rss
    feeds = {i.name: np.ones((1, i.shape[1]), np.float32) for i in sess.get_inputs()}
    sess.run(None, feeds)
    rss2 = proc.memory_info().rss
    return {"load_mb": round((rss1 - rss0) / 2**20, 1), "after_run_mb": round((rss2 - rss0) / 2**20, 1)}


def memory(a: argparse.Namespace) -> None:
    import json
    import subprocess
    import sys

    model = GGUFTensors(a.gguf)
    with tempfile.TemporaryDirectory(prefix="layers-") as tmp:
        weights = WeightFile(Path(tmp) / "weights.data")
        paths = {v: all_layers(model, v, weights, Path(tmp)) for v in a.variants}
        weights.close()
        results: dict[str, list[dict]] = {v: [] for v in paths}
        for _ in range(a.rounds):
            for v, p in paths.items():
                cmd = [sys.executable, "-m", "bench.experiments.gguf_linears", str(a.gguf), "--probe", str(p)]
                out = subprocess.run(
                    [*cmd, "--threads", str(a.threads)], check=True, capture_output=True, text=True
                )
                results[v].append(json.loads(out.stdout))
        print(f"{a.gguf.name}: all layers' projections, medians of {a.rounds} processes")
        print("| variant | weights referenced (MB) | RSS at load (MB) | after one run (MB) |")
        print("|---|---|---|---|")
        for v, rs in results.items():
            from models.convert.pipeline import referenced_bytes

            ref = referenced_bytes(paths[v]) / 2**20
            load = statistics.median(r["load_mb"] for r in rs)
            run = statistics.median(r["after_run_mb"] for r in rs)
            print(f"| {v} | {ref:.0f} | {load:.0f} | {run:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--layers", nargs="*", type=int, default=[0, 2])
    ap.add_argument("--variants", nargs="*", default=["q4", "q4-a8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        import json

        print(json.dumps(probe_memory(a.probe, a.threads)))
        return
    if a.memory:
        memory(a)
        return
    model = GGUFTensors(a.gguf)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="linears-") as tmp:
        weights = WeightFile(Path(tmp) / "weights.data")
        cases = {}
        for layer in a.layers:
            for proj, parts in PROJECTIONS.items():
                names = [f"blk.{layer}.{p}" for p in parts]
                types = "+".join(model.tensor(x).type_name for x in names)
                for v in a.variants:
                    cases[(layer, proj, types, v)] = build(model, v, layer, proj, weights, Path(tmp))
        weights.close()
        sessions = {
            c: ort.InferenceSession(str(p), session_options(a.threads), providers=["CPUExecutionProvider"])
            for c, p in cases.items()
        }
        inputs = {}
        errors = {}
        for c, sess in sessions.items():
            layer, proj, _, _ = c
            names = [f"blk.{layer}.{p}" for p in PROJECTIONS[proj]]
            w = np.concatenate([model.tensor(x).dequantize() for x in names]).astype(np.float64)
            x = rng.standard_normal((4, w.shape[1])).astype(np.float32)
            want = x.astype(np.float64) @ w.T
            got = sess.run(None, {"x": x})[0]
            errors[c] = float(np.abs(got - want).max() / np.abs(want).max())
            inputs[c] = {m: rng.standard_normal((m, w.shape[1])).astype(np.float32) for m in (1, 256)}
        times = {(c, m): [] for c in sessions for m in (1, 256)}
        order = list(sessions)
        for r in range(a.rounds):  # every case once per round, the order rotating: drift hits all alike
            for c in order[r % len(order) :] + order[: r % len(order)]:
                for m, reps in ((1, 10), (256, 2)):
                    sessions[c].run(None, {"x": inputs[c][m]})
                    t = time.perf_counter()
                    for _ in range(reps):
                        sessions[c].run(None, {"x": inputs[c][m]})
                    times[c, m].append((time.perf_counter() - t) / reps * 1000)
        print(f"{a.gguf.name}, {a.threads} threads, median ms per call over {a.rounds} interleaved rounds")
        print("| layer | projection | types | variant | max rel. error vs float64 | M=1 ms | M=256 ms |")
        print("|---|---|---|---|---|---|---|")
        for c in sessions:
            layer, proj, types, v = c
            t1, t256 = statistics.median(times[c, 1]), statistics.median(times[c, 256])
            print(f"| {layer} | {proj} | {types} | {v} | {errors[c]:.1e} | {t1:.2f} | {t256:.1f} |")


if __name__ == "__main__":
    main()
