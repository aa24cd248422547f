"""Micro-benchmark: can Gemma 3's 8-bit-mapped tensors (Q5_0, Q6_K) run faster as sums of narrower
MatMulNBits terms than as one 8-bit MatMulNBits?

    python -m studies.experiments.split_8bit [--threads 1 2] [--rounds 7]
        [--json studies/results/experiments/NAME.json]

The idea, for the q4-a8 variant: a Q5_0 weight is d * (q - 16) with q = lo4 + 16 * hi1, so it is exactly
the sum of a 4-bit term d * (lo4 - 8) and a term holding the high bit, 8d * (2 * hi1 - 1), which fits 2 bits
(codes 2*hi1 + 1, zero point 2) or 4 bits (codes 7 + 2*hi1, zero point 8), over the same 32-wide blocks and
with the default zero points (no zero-point tensor). Q6_K (16-wide blocks) is q6 = lo4 + 16 * hi2: d * (lo4 -
8) + 8d * (2 * hi2 - 3) as 4 + 4 bits (codes 5 + 2*hi2), or 16d * (hi2 - 2) as 2 bits plus 8d times each
block's sum of x (the converter's existing per-block correction). Scales are fp32, so 8d and 16d are exact.
With int8 activations (accuracy_level 4) every term quantizes the same 32- (16-) wide blocks of x the same
way, so the sum equals the 8-bit product up to float summation order.

Candidates per shape (all y = x @ W^T over the same random codes):
- `8-bit`: what converter 8 does (one MatMulNBits, bits 8);
- `4+2 (2 nodes)`, `4+4 (2 nodes)`: two MatMulNBits over x, then Add;
- `4+2 LUT`: the same with the session option `mlas.use_lut_gemm` (onnxruntime's T-MAC 2-bit kernel);
- `4-bit over [x, x]`: one MatMulNBits over Concat(x, x), K doubled (both terms in one node);
- `4-bit alone`: the floor, what a matrix that is 4-bit in the GGUF costs (its numbers are not Q5_0's);
- `fp32 MatMul`: on the dequantized weights (4x the bytes of the 8-bit codes; the exact variant's route for
  8-bit tensors, models/convert/linear.py), the same graph at both accuracy levels.
`--acc 1` runs the MatMulNBits candidates with fp32 activations (accuracy_level 1, the exact variant).

Timing as in studies/experiments/quant_routes.py: every session built first, then timed round-robin (the order
rotates each round) in one process, so drift on a shared machine hits every candidate alike; medians per call.
At M = 1 each candidate holds `--copies` distinct weight sets (outputs summed) so the weights stream from
memory as in a decode step. Numerics: max |y - ref| / max |ref| against a numpy reference of the exactly
dequantized weights (fp32 x) and against a numpy model of int8 activations (x rounded per block to amax/127),
plus the difference from the 8-bit node's own output.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
from onnx import helper

from studies.experiments.quant_routes import matmul_session

MS = "com.microsoft"
ZP = {2: 2, 4: 8, 8: 128}

# name: (N, K, GGUF type) in Gemma 3 270M; gate and up are fused (one node), as are q, k and v
SHAPES = {
    "gate_up 4096x640 Q5_0": (4096, 640, "Q5_0"),
    "qkv 1536x640 Q5_0": (1536, 640, "Q5_0"),
    "down 640x2048 Q6_K": (640, 2048, "Q6_K"),
}


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(n, nb, block) codes -> MatMulNBits bytes: element j of a block in bits (j % per) * bits of byte
    j // per, low bits first (2i low nibble, 2i+1 high nibble for 4 bits)."""
    per = 8 // bits
    n, nb, blk = codes.shape
    out = np.zeros((n, nb, blk // per), np.uint8)
    for i in range(per):
        out |= (codes[..., i::per].astype(np.uint8) << (bits * i)).astype(np.uint8)
    return out


@dataclass
class Term:
    """One MatMulNBits node: W_term[n, j] = scale[n, j // block] * (codes[n, j] - ZP[bits])."""

    bits: int
    block: int
    codes: np.ndarray  # (n, nb, block) uint8
    scales: np.ndarray  # (n, nb) float32
    doubled: bool = False  # input is Concat(x, x) (K doubled)

    def weight(self) -> np.ndarray:
        w = self.scales[..., None].astype(np.float64) * (self.codes.astype(np.float64) - ZP[self.bits])
        return w.reshape(w.shape[0], -1)


@dataclass
class Candidate:
    terms: list[Term]
    correction: np.ndarray | None = None  # (nb, n): y += blocksum_block(x) @ correction
    corr_block: int = 32
    options: dict[str, str] = field(default_factory=dict)


@dataclass
class Weights:
    """One random matrix in GGUF terms: integer q in 0..2^bits-1 and a per-block scale d (fp16-exact)."""

    q: np.ndarray  # (n, nb, block) uint8
    d: np.ndarray  # (n, nb) float32
    center: int

    @property
    def block(self) -> int:
        return self.q.shape[2]

    def dequantize(self) -> np.ndarray:
        w = self.d[..., None].astype(np.float64) * (self.q.astype(np.float64) - self.center)
        return w.reshape(self.q.shape[0], -1)


def random_weights(n: int, k: int, fmt: str, seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    block, bits = {"Q5_0": (32, 5), "Q6_K": (16, 6)}[fmt]
    q = rng.integers(0, 2**bits, (n, k // block, block)).astype(np.uint8)
    d = (rng.random((n, k // block)) * 0.01 + 0.001).astype(np.float16).astype(np.float32)
    return Weights(q, d, 2 ** (bits - 1))


def candidates(w: Weights, acc: int) -> dict[str, Candidate]:
    lo, hi = w.q & 15, w.q >> 4
    d, blk = w.d, w.block
    eight = Candidate([Term(8, blk, (w.q.astype(np.int16) - w.center + 128).astype(np.uint8), d)])
    a = Term(4, blk, lo, d)
    if w.center == 16:  # Q5_0: 8d * (2*hi - 1)
        b4 = Term(4, blk, (7 + 2 * hi).astype(np.uint8), 8 * d)
        b2 = Candidate([a, Term(2, blk, (2 * hi + 1).astype(np.uint8), 8 * d)])
    else:  # Q6_K: 8d * (2*hi - 3) at 4 bits; 16d * (hi - 2) + 8d at 2 bits
        b4 = Term(4, blk, (5 + 2 * hi).astype(np.uint8), 8 * d)
        b2 = Candidate([a, Term(2, blk, hi.astype(np.uint8), 16 * d)], (8 * d).T.copy(), blk)
    pair = [
        Term(4, blk, np.concatenate([a.codes, b4.codes], 1), np.concatenate([a.scales, b4.scales], 1), True)
    ]
    out = {"8-bit": eight, "4+2 (2 nodes)": b2, "4+4 (2 nodes)": Candidate([a, b4])}
    if acc == 4 and blk % 32 == 0:
        out["4+2 LUT"] = Candidate(b2.terms, b2.correction, b2.corr_block, {"mlas.use_lut_gemm": "1"})
    out["4-bit over [x, x]"] = Candidate(pair)
    out["4-bit alone (floor)"] = Candidate([a])
    return out


def graph(cands: list[Candidate], k: int, n: int, acc: int) -> tuple[list, dict]:
    """Nodes and initializers summing the candidates `cands` (copies of one form over distinct weights)."""
    nodes, inits, outs = [], {}, []
    if any(t.doubled for c in cands for t in c.terms):
        nodes.append(helper.make_node("Concat", ["x", "x"], ["xx"], axis=1))
    for ci, c in enumerate(cands):
        for ti, t in enumerate(c.terms):
            p = f"c{ci}t{ti}"
            kk = 2 * k if t.doubled else k
            inits[f"{p}w"], inits[f"{p}s"] = pack(t.codes, t.bits), t.scales.astype(np.float32)
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    ["xx" if t.doubled else "x", f"{p}w", f"{p}s"],
                    [f"{p}y"],
                    domain=MS,
                    K=kk,
                    N=n,
                    bits=t.bits,
                    block_size=t.block,
                    accuracy_level=acc,
                )
            )
            outs.append(f"{p}y")
        if c.correction is not None:
            nb = k // c.corr_block
            ind = np.kron(np.eye(nb, dtype=np.float32), np.ones((c.corr_block, 1), np.float32))
            inits["ind"], inits[f"c{ci}corr"] = ind, c.correction.astype(np.float32)
            if not any(nd.output[0] == "bsum" for nd in nodes):
                nodes.append(helper.make_node("MatMul", ["x", "ind"], ["bsum"]))
            nodes.append(helper.make_node("MatMul", ["bsum", f"c{ci}corr"], [f"c{ci}cy"]))
            outs.append(f"c{ci}cy")
    nodes.append(helper.make_node("Sum" if len(outs) > 1 else "Identity", outs, ["y"]))
    return nodes, inits


def fp32_graph(ws: list[Weights]) -> tuple[list, dict]:
    """fp32 MatMul on the dequantized weights (the exact variant's route today), copies summed."""
    nodes, inits, outs = [], {}, []
    for i, w in enumerate(ws):
        inits[f"w{i}"] = np.ascontiguousarray(w.dequantize().T.astype(np.float32))
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        outs.append(f"y{i}")
    nodes.append(helper.make_node("Sum" if len(outs) > 1 else "Identity", outs, ["y"]))
    return nodes, inits


def int8_reference(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """x quantized per `block`-wide block to round(x / s), s = amax / 127 (MLAS's int8 activations)."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block).astype(np.float64)
    s = np.abs(xb).max(axis=-1, keepdims=True) / 127.0
    xq = np.round(xb / np.where(s == 0, 1, s)) * s
    return xq.reshape(m, k) @ w.T


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def bench_shape(shape: str, acc: int, ms: list[int], threads: list[int], rounds: int, ncopies: int) -> list:
    n, k, fmt = SHAPES[shape]
    rows = []
    for m in ms:
        c = ncopies if m == 1 else 1
        ws = [random_weights(n, k, fmt, seed) for seed in range(c)]
        forms = [candidates(w, acc) for w in ws]
        names = list(forms[0])
        x = np.random.default_rng(100).standard_normal((m, k)).astype(np.float32)
        exact = sum(x.astype(np.float64) @ w.dequantize().T for w in ws)
        a8 = sum(int8_reference(x, w.dequantize(), w.block) for w in ws)
        for th in threads:
            sessions = {}
            for name in names:
                cs = [f[name] for f in forms]
                sessions[name] = matmul_session(*graph(cs, k, n, acc), k, n, th, cs[0].options)
            names_t = [*names, "fp32 MatMul"]
            sessions["fp32 MatMul"] = matmul_session(*fp32_graph(ws), k, n, th, {})
            outs = {name: sessions[name].run(None, {"x": x})[0] for name in names_t}
            times: dict[str, list[float]] = {name: [] for name in names_t}
            reps = 20 if m == 1 else 2
            for r in range(rounds):
                order = names_t[r % len(names_t) :] + names_t[: r % len(names_t)]
                for name in order:
                    s = sessions[name]
                    s.run(None, {"x": x})
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        s.run(None, {"x": x})
                    times[name].append((time.perf_counter() - t0) / reps * 1000)
            base = statistics.median(times["8-bit"])
            what = "int8 activations (acc 4)" if acc == 4 else "fp32 activations (acc 1)"
            print(f"\n{shape}, {what}, M={m}, x{c} matrices, {th} thread(s): median ms/call, {rounds} rounds")
            head = ("candidate", "ms", "vs 8-bit", "err exact", "err a8", "vs 8-bit")
            print("  {:24s} {:>9s} {:>8s}  {:>9s} {:>9s} {:>9s}".format(*head))
            for name in names_t:
                med = statistics.median(times[name])
                row = {
                    "shape": shape,
                    "accuracy_level": acc,
                    "m": m,
                    "copies": c,
                    "threads": th,
                    "candidate": name,
                    "median_ms": round(med, 4),
                    "ms_rounds": [round(t, 4) for t in times[name]],
                    "ratio_to_8bit": round(med / base, 3),
                    "err_vs_exact": rel(outs[name], exact),
                    "err_vs_int8_model": rel(outs[name], a8),
                    "err_vs_8bit_node": rel(outs[name], outs["8-bit"]),
                }
                rows.append(row)
                print(
                    f"  {name:24s} {med:9.3f} {med / base:7.2f}x  {row['err_vs_exact']:9.1e} "
                    f"{row['err_vs_int8_model']:9.1e} {row['err_vs_8bit_node']:9.1e}"
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", nargs="*", type=int, default=[2, 1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", nargs="*", type=int, default=[1, 256])
    ap.add_argument("--acc", nargs="*", type=int, default=[4, 1])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--copies", type=int, default=6, help="distinct matrices per call at M=1")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    for acc in a.acc:
        for shape in a.shapes:
            rows += bench_shape(shape, acc, a.m, a.threads, a.rounds, a.copies)
    if a.json:
        meta = {
            "onnxruntime": ort.__version__,
            "machine": platform.processor() or platform.machine(),
            "note": "shared machine (other jobs running); compare ratios within one shape/M/threads block",
            "args": vars(a),
        }
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
