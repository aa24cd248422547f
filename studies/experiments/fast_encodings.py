"""What each candidate encoding of a model's matrices costs per token in onnxruntime (MatMulNBits, int8
activations): the micro-benchmark that chose the `fast` variant's encoding (models/convert/requant.py).

    python -m studies.experiments.fast_encodings [--model qwen2.5-1.5b] [--layers 8] [--rounds 3]
        [--threads 2]

One graph per candidate holds `--layers` layers of the model's real shapes (fused QKV, output, fused
gate+up, down), every matrix with its own random codes, so the weights stream from memory as in a decode
step; a second graph holds the LM head alone. Sessions are built one at a time (a whole model's worth of
packed weights per candidate would not fit beside the others), timed, and dropped; the candidate order
rotates every round so drift on a shared machine hits each alike. Prints JSON: per candidate the median ms
of one decode row (M=1) and of a 256-row prefill, scaled to the model's layer count, and the bytes of its
initializers per weight.

Candidates (all accuracy_level 4: int8 activations):
- `b32+corr`: the exact route of a GGUF format with a min (Q4_1, Q4_K): 4-bit block 32 under the default
  zero point, plus the block sums of x (a MatMul) times the per-block correction (a Gemm);
- `b{32,64,128}` symmetric 4-bit (default zero point 8), `b{32,64,128}zp` with a uint4 zero point per block;
- `8b{16,32,128}`: 8-bit codes (Q6_K's exact block is 16, Q8_0's 32).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"

# (hidden, feed-forward, q heads x head_dim, kv heads x head_dim, layers, vocab)
MODELS = {
    "smollm2-135m": (576, 1536, 576, 192, 30, 49152),
    "gemma3-270m": (640, 2048, 1024, 256, 18, 262144),
    "qwen2.5-0.5b": (896, 4864, 896, 128, 24, 151936),
    "qwen2.5-1.5b": (1536, 8960, 1536, 256, 28, 151936),
}
CANDIDATES = ("b32+corr", "b32", "b32zp", "b64", "b64zp", "b128", "b128zp", "8b16", "8b32", "8b128")


def spec(name: str) -> tuple[int, int, bool, bool]:
    """candidate -> (bits, block, explicit zero points, correction)."""
    if name.startswith("8b"):
        return 8, int(name[2:]), False, False
    corr = name.endswith("+corr")
    zp = name.endswith("zp")
    block = int(name[1:].removesuffix("+corr").removesuffix("zp"))
    return 4, block, zp, corr


class Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.n = 0
        self.rng = np.random.default_rng(0)
        self.shared: set[str] = set()

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def add(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def matrix(self, x: str, n: int, k: int, cand: str) -> str:
        bits, block, zp, corr = spec(cand)
        if k % block:
            block = 64 if k % 64 == 0 else 32  # as the converter does: the widest block that divides K
        nb = k // block
        w = self.add(self.name("w"), self.rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8))
        s = self.add(self.name("s"), (self.rng.random((n, nb), np.float32) * 0.01).astype(np.float32))
        inputs = [x, w, s]
        if zp:
            zcols = (nb + 1) // 2 if bits == 4 else nb
            inputs.append(self.add(self.name("z"), self.rng.integers(0, 256, (n, zcols), dtype=np.uint8)))
        y = self.name("y")
        self.nodes.append(
            helper.make_node(
                "MatMulNBits", inputs, [y], domain=MS, K=k, N=n, bits=bits, block_size=block, accuracy_level=4
            )
        )
        if not corr:
            return y
        # one indicator per input size, shared as the converter shares it (read from cache, not memory)
        ind = f"block_indicator_{k}_{block}"
        if ind not in self.shared:
            self.shared.add(ind)
            self.add(ind, np.kron(np.eye(nb, dtype=np.float32), np.ones((block, 1), np.float32)))
        sums = self.name("sums")
        self.nodes.append(helper.make_node("MatMul", [x, ind], [sums]))
        c = self.add(self.name("c"), (self.rng.random((nb, n), np.float32) * 0.01).astype(np.float32))
        out = self.name("yc")
        self.nodes.append(helper.make_node("Gemm", [sums, c, y], [out]))
        return out

    def save(self, path: Path, k_in: int, k_ff: int) -> Path:
        inputs = [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k_in]),
            helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["m", k_ff]),
        ]
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", None])]
        model = helper.make_model(
            helper.make_graph(self.nodes, "g", inputs, outputs, self.inits),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
        )
        model.ir_version = 8
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
        return path


def layers_graph(path: Path, model: str, layers: int, cand: str) -> Path:
    """Every matrix of `layers` layers reads x (or x2 for down); the outputs are summed into one so that
    nothing is pruned and the output copy stays small."""
    hidden, ff, q, kv, _, _ = MODELS[model]
    g = Graph()
    outs = []
    for _ in range(layers):
        qkv = g.matrix("x", q + 2 * kv, hidden, cand)
        o = g.matrix("x", hidden, q, cand) if q == hidden else g.matrix("x", hidden, hidden, cand)
        gu = g.matrix("x", 2 * ff, hidden, cand)
        d = g.matrix("x2", hidden, ff, cand)
        for y in (qkv, o, gu, d):
            r = g.name("r")
            g.nodes.append(helper.make_node("ReduceSum", [y], [r], keepdims=1, axes=None))
            outs.append(r)
    g.nodes.append(helper.make_node("Sum", outs, ["y"]))
    return g.save(path, hidden, ff)


def head_graph(path: Path, model: str, cand: str) -> Path:
    hidden, ff, _, _, _, vocab = MODELS[model]
    g = Graph()
    y = g.matrix("x", vocab, hidden, cand)
    g.nodes.append(helper.make_node("ReduceSum", [y], ["y"], keepdims=1))
    g.nodes.append(helper.make_node("ReduceSum", ["x2"], ["unused"], keepdims=1))
    return g.save(path, hidden, ff)


def session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_mem_pattern = False
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def time_calls(sess: ort.InferenceSession, k_in: int, k_ff: int, m: int, calls: int) -> float:
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((m, k_in), np.float32),
        "x2": rng.standard_normal((m, k_ff), np.float32),
    }
    sess.run(None, feeds)  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def init_bytes(path: Path) -> int:
    return (path.parent / (path.name + ".data")).stat().st_size


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-calls", type=int, default=20)
    ap.add_argument("--prefill-calls", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=list(CANDIDATES))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    hidden, ff, q, kv, n_layers, vocab = MODELS[a.model]
    params_layers = a.layers * (hidden * (q + 2 * kv) + hidden * q + 3 * ff * hidden)
    results: dict[str, dict[str, list[float]]] = {c: {} for c in a.only}
    sizes: dict[str, dict[str, int]] = {c: {} for c in a.only}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        paths = {}
        for c in a.only:
            paths[c] = (
                layers_graph(Path(tmp) / f"layers-{c}.onnx", a.model, a.layers, c),
                head_graph(Path(tmp) / f"head-{c}.onnx", a.model, c),
            )
            sizes[c] = {"layers": init_bytes(paths[c][0]), "head": init_bytes(paths[c][1])}
        for r in range(a.rounds):
            order = a.only[r % len(a.only) :] + a.only[: r % len(a.only)]
            for c in order:
                for part, path in zip(("layers", "head"), paths[c], strict=True):
                    sess = session(path, a.threads)
                    for m, calls, key in ((1, a.decode_calls, "decode"), (256, a.prefill_calls, "prefill")):
                        ms = time_calls(sess, hidden, ff, m, calls)
                        results[c].setdefault(f"{part}_{key}", []).append(ms)
                    del sess
    scale = n_layers / a.layers
    table = {}
    for c in a.only:
        med = {k: statistics.median(v) for k, v in results[c].items()}
        table[c] = {
            "decode_ms_per_token": round(med["layers_decode"] * scale + med["head_decode"], 3),
            "layers_decode_ms": round(med["layers_decode"] * scale, 3),
            "head_decode_ms": round(med["head_decode"], 3),
            "prefill_ms_256": round(med["layers_prefill"] * scale + med["head_prefill"], 1),
            "bits_per_weight_layers": round(8 * sizes[c]["layers"] / params_layers, 3),
            "bits_per_weight_head": round(8 * sizes[c]["head"] / (vocab * hidden), 3),
        }
    out = {
        "bench": "fast_encodings",
        "model_shapes": a.model,
        "layers_timed": a.layers,
        "threads": a.threads,
        "rounds": a.rounds,
        "onnxruntime": ort.__version__,
        "machine": platform.machine(),
        "note": "one decode row and a 256-row prefill, medians over interleaved rounds; shared machine",
        "candidates": table,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
