"""Micro-benchmark of the ways one quantized matrix can run in onnxruntime, on Gemma-3-270M-sized shapes.

    python -m studies.experiments.quant_routes [--threads 2] [--rounds 7] [--only NAME ...]

Each candidate is a one-node (or two-node) ONNX graph y = x @ W^T over random codes. All sessions are
created first, then timed round-robin (the order rotates every round) so that drift on a shared machine hits
every candidate alike; the table shows medians per call in ms. This is what chose the exact variant's route
for 8-bit tensors (see models/convert/linear.py).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def _nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def matmul_session(
    nodes, inits, k: int, n: int, threads: int, options: dict[str, str] | None = None
) -> ort.InferenceSession:
    """x [m, k] -> y [m, n] over `nodes`, quiet threads; `options`: more session config entries."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(a, name) for name, a in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)], ir_version=8
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (options or {}).items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def mnb(n: int, k: int, bits: int, block: int, acc: int, zp: bool = False, twice: bool = False, rng=None):
    """MatMulNBits over random codes; `twice`: the input is Concat(x, x) (the nibble pair)."""
    rng = rng or np.random.default_rng(0)
    kk = 2 * k if twice else k
    nb = kk // block
    q = rng.integers(0, 2**bits, (n, nb, block))
    packed = _nibbles(q) if bits == 4 else q.astype(np.uint8)
    inits = {"w": packed, "s": (rng.random((n, nb), np.float32) * 0.01)}
    inputs = ["xx" if twice else "x", "w", "s"]
    if zp:
        z = np.zeros((n, nb), np.uint8)
        inits["z"] = _nibbles(np.pad(z, ((0, 0), (0, nb % 2)))) if bits == 4 else z
        inputs.append("z")
    nodes = [helper.make_node("Concat", ["x", "x"], ["xx"], axis=1)] if twice else []
    nodes.append(
        helper.make_node(
            "MatMulNBits",
            inputs,
            ["y"],
            domain=MS,
            K=kk,
            N=n,
            bits=bits,
            block_size=block,
            accuracy_level=acc,
        )
    )
    return nodes, inits


def fp32(n: int, k: int, rng=None):
    rng = rng or np.random.default_rng(0)
    return [helper.make_node("MatMul", ["x", "wt"], ["y"])], {"wt": rng.random((k, n), np.float32)}


SHAPES = {  # name: (N, K) in Gemma 3 270M
    "qkv 1536x640": (1536, 640),
    "gate_up 4096x640": (4096, 640),
    "down 640x2048": (640, 2048),
    "head 262144x640": (262144, 640),
}


def _concat(parts: list[tuple], prefix: tuple[str, ...]) -> tuple:
    """Several candidates over the same x, outputs concatenated along N (a fused projection kept apart)."""
    nodes, inits, outs = [], {}, []
    for i, (pn, pi) in enumerate(parts):
        ren = {name: f"{prefix[i]}{name}" for name in pi}
        ren |= {o: f"{prefix[i]}{o}" for nd in pn for o in nd.output} | {"y": f"y{i}"}
        for node in pn:
            node.input[:] = [ren.get(x, x) for x in node.input]
            node.output[:] = [ren.get(x, x) for x in node.output]
        nodes += pn
        inits |= {ren[name]: a for name, a in pi.items()}
        outs.append(f"y{i}")
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    return nodes, inits


def group(name: str, n: int, k: int) -> dict[str, tuple]:
    """The candidates of one question, all over x [M, k] -> y [M, n]."""
    if name == "route8":  # the exact variant's 8-bit tensors: which route?
        return {
            "8-bit acc4 (int8 act, not exact)": mnb(n, k, 8, 32, 4),
            "8-bit acc1 (fp32 act)": mnb(n, k, 8, 32, 1),
            "nibble pair 4-bit acc1": mnb(n, k, 4, 32, 1, zp=True, twice=True),
            "fp32 MatMul": fp32(n, k),
            "4-bit acc1 (a Q4 matrix)": mnb(n, k, 4, 32, 1),
        }
    if name == "zp":  # Q4_1/Q4_K: default zero point + shifted correction, or explicit zero points 0?
        return {f"4-bit acc{a}{z}": mnb(n, k, 4, 32, a, zp=bool(z)) for a in (1, 4) for z in ("", " + zp")}
    if name == "block":  # 16-wide blocks (Q6_K, Q2_K, Q3_K; Q5_0 promoted to fuse with Q6_K) vs 32
        return {
            f"{bits}-bit acc{a} block {b}": mnb(n, k, bits, b, a)
            for bits in (4, 8)
            for a in (1, 4)
            for b in (32, 16)
            if not (bits == 8 and a == 1)
        }
    if name == "mixed":  # Q4_K_M-style qkv: q,k 4-bit, v 8-bit block 16 (N split 5/6 : 1/6)
        nv = n // 6
        return {
            "int8 act: 4-bit + 8-bit b16 + Concat": _concat(
                [mnb(n - nv, k, 4, 32, 4), mnb(nv, k, 8, 16, 4)], ("a", "b")
            ),
            "int8 act: all promoted to 8-bit b16": mnb(n, k, 8, 16, 4),
            "fp32 act: 4-bit + fp32 MatMul + Concat": _concat(
                [mnb(n - nv, k, 4, 32, 1), fp32(nv, k)], ("a", "b")
            ),
            "fp32 act: all promoted to fp32 MatMul": fp32(n, k),
        }
    raise ValueError(name)


def copies(cands: dict[str, tuple], c: int) -> dict[str, tuple]:
    """Each candidate `c` times with its own weights, outputs summed: the working set of `c` layers, so the
    weights stream from memory as in a real decode step instead of staying in cache between calls."""
    if c == 1:
        return cands
    out = {}
    for name, (nodes, inits) in cands.items():
        parts = []
        for i in range(c):
            rng = np.random.default_rng(i)
            parts.append(
                ([copy.deepcopy(nd) for nd in nodes], {n: rng.permutation(a) for n, a in inits.items()})
            )
        nodes2, inits2 = _concat(parts, tuple(f"c{i}_" for i in range(c)))
        nodes2[-1] = helper.make_node("Sum", list(nodes2[-1].input), ["y"])
        out[name] = (nodes2, inits2)
    return out


def bench(
    shape: str, grp: str, ms: list[int], threads: int, rounds: int, only: list[str], ncopies: int = 1
) -> None:
    n, k = SHAPES[shape]
    sessions = {}
    for name, (nodes, inits) in copies(group(grp, n, k), ncopies).items():
        if only and not any(o in name for o in only):
            continue
        if n > 100_000 and name.startswith("8-bit acc1"):
            continue  # ~0.8 s a call: measured once in MODEL_NOTES, not worth the machine time
        sessions[name] = matmul_session(nodes, inits, k, n, threads)
    rng = np.random.default_rng(1)
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        names = list(sessions)
        reps = 2 if n > 100_000 or m > 1 else 20
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                s = sessions[name]
                s.run(None, {"x": x})  # warm
                t0 = time.perf_counter()
                for _ in range(reps):
                    s.run(None, {"x": x})
                times[name].append((time.perf_counter() - t0) / reps * 1000)
        base = statistics.median(times[names[0]])
        print(
            f"\n[{grp}] {shape} x{ncopies}, M={m}, {threads} threads: median ms per call over {rounds} rounds"
        )
        for name in names:
            med = statistics.median(times[name])
            print(f"  {name:40s} {med:9.3f}  {med / base:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--m", nargs="*", type=int, default=[1, 256])
    ap.add_argument("--groups", nargs="*", default=["route8", "zp", "block", "mixed"])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--copies", type=int, default=1, help="distinct matrices per call (see copies())")
    a = ap.parse_args()
    for grp in a.groups:
        for shape in a.shapes:
            if grp in ("route8",) or not shape.startswith("head"):
                bench(shape, grp, a.m, a.threads, a.rounds, a.only, a.copies)


if __name__ == "__main__":
    main()
