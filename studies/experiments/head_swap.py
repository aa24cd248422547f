"""`q4-a8` with its 8-bit head as DynamicQuantizeMatMul: what it costs the A72 and what it does to quality.

On a Cortex-A72 the 8-bit MatMulNBits head is 60 % of a decode step (docs/cpu-classes.md): onnxruntime has
no int8 kernel for it without the dot product and dequantizes the whole table every call. head_routes.py
counted DynamicQuantizeMatMul (int8 weights, one scale per row; MLAS's integer GEMM, which has a NEON
kernel without the dot product) at 1/40 of that. Here the variant's own head is swapped: its Q8_0 codes
dequantized, then either re-quantized per row to int8 (symmetric, scale max|row| / 127) for
DynamicQuantizeMatMul, or kept as fp32 for a plain MatMul (exact: what the A72's route computes now, the
table dequantized once at load instead of on every call); everything else unchanged.

- quality, natively: one teacher-forced pass over an English text, logits of the f32 variant (the
  reference), `q4-a8` and the swapped graph; KL(reference || each) per position, top-1 agreement;
- cost: the swapped graph's decode step by operator, counted as `cpu-cost --by-op` counts (by_op.py).

    python -m studies.experiments.head_swap --model-dir DIR [--cpu cortex-a72 --arm64-root ROOT] [--json OUT]

DIR: a folder with `f32` and `q4-a8` (the test suite's conversion of SmolLM2 has both).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HEAD_Q, HEAD_S = "token_embd.qweight", "token_embd.scales"
TEXT_FILES = ("README.md", "docs/architecture.md")


HEADS = ("int8-row", "fp32")


def swapped(model_dir: Path, into: Path, head: str) -> Path:
    """q4-a8's graph with the head node replaced (`head`: one of HEADS); its weights written under `into`."""
    import onnx
    from onnx import helper, numpy_helper

    manifest = json.loads((model_dir / "manifest.json").read_text())
    m = onnx.load(str(model_dir / manifest["variants"]["q4-a8"]["file"]))
    inits = {t.name: t for t in m.graph.initializer}
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1] == HEAD_Q)
    q = numpy_helper.to_array(inits[HEAD_Q]).astype(np.int16) - 128  # MatMulNBits' default 8-bit zero point
    s = numpy_helper.to_array(inits[HEAD_S])
    w = (q * s[..., None]).reshape(q.shape[0], -1).astype(np.float32)  # (vocab, hidden)
    if head == "fp32":
        new = helper.make_node("MatMul", [node.input[0], "head.fp32"], list(node.output), name="head_matmul")
        weights = [numpy_helper.from_array(np.ascontiguousarray(w.T), "head.fp32")]
    else:
        row_scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127
        w8 = np.clip(np.rint(w / row_scale[:, None]), -127, 127).astype(np.int8)
        new = helper.make_node(
            "DynamicQuantizeMatMul",
            [node.input[0], "head.int8", "head.int8_scale"],
            list(node.output),
            name="head_dynamic_quantize_matmul",
            domain="com.microsoft",
        )
        weights = [
            numpy_helper.from_array(np.ascontiguousarray(w8.T), "head.int8"),
            numpy_helper.from_array(row_scale.astype(np.float32), "head.int8_scale"),
        ]
    nodes = [new if n is node else n for n in m.graph.node]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    kept = [t for t in m.graph.initializer if t.name not in (HEAD_Q, HEAD_S)]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    m.graph.initializer.extend(weights)
    out = into / f"q4-a8-{head}-head.onnx"
    onnx.save(m, str(out), save_as_external_data=True, location=f"{head}.data", size_threshold=1024)
    return out


def text_ids(model_dir: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    repo = Path(__file__).resolve().parents[2]
    text = "\n".join((repo / f).read_text() for f in TEXT_FILES)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids[:n]


def logits(onnx_path: Path, ids: list[int]) -> np.ndarray:
    """One pass over `ids` from an empty cache, every position's logits."""
    import onnxruntime as ort

    from models.runtime.session import session_options

    sess = ort.InferenceSession(str(onnx_path), session_options(1), providers=["CPUExecutionProvider"])
    t = len(ids)
    feed: dict[str, Any] = {}
    for inp in sess.get_inputs():
        if inp.name == "input_ids":
            feed[inp.name] = np.array([ids], np.int64)
        elif inp.name == "attention_mask":
            feed[inp.name] = np.ones((1, t), np.int64)
        elif inp.name.startswith("past_key_values."):
            dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
            dims = [1 if d == "batch" else 0 if isinstance(d, str) else d for d in inp.shape]
            feed[inp.name] = np.zeros(dims, dtype)
        elif inp.name == "num_logits_to_keep":
            feed[inp.name] = np.array(t, np.int64)
    return np.asarray(sess.run(["logits"], feed)[0])[0].astype(np.float64)


def kl_rows(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(other)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def quality(ref: np.ndarray, other: np.ndarray) -> dict[str, float]:
    kl = kl_rows(ref, other)
    return {
        "kl_mean": round(float(kl.mean()), 6),
        "kl_p99": round(float(np.quantile(kl, 0.99)), 6),
        "kl_max": round(float(kl.max()), 6),
        "top1_agreement": round(float((ref.argmax(-1) == other.argmax(-1)).mean()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.experiments.head_swap")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--cpu", action="append", default=[], help="count the swapped step on this class too")
    ap.add_argument("--arm64-root", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    manifest = json.loads((args.model_dir / "manifest.json").read_text())
    report: dict[str, Any] = {
        "model": str(args.model_dir),
        "heads": {h: f"q4-a8 with a {h} head" for h in HEADS},
    }
    with tempfile.TemporaryDirectory(prefix="head-swap-", dir="/var/tmp") as tmp:
        paths = {h: swapped(args.model_dir, Path(tmp), h) for h in HEADS}
        ids = text_ids(args.model_dir, args.positions)
        ref = logits(args.model_dir / manifest["variants"]["f32"]["file"], ids)
        report["positions"] = len(ids)
        report["quality_vs_f32"] = {
            "q4-a8": quality(ref, logits(args.model_dir / manifest["variants"]["q4-a8"]["file"], ids)),
            **{f"q4-a8, {h} head": quality(ref, logits(p, ids)) for h, p in paths.items()},
        }
        print(json.dumps(report, indent=1), flush=True)
        if args.cpu:
            from bench.cpu_cost.by_op import count_plan
            from bench.cpu_cost.count import CLASSES
            from bench.cpu_cost.cut import write_plan
            from bench.cpu_cost.run import build

            report["counted"] = {}
            for h, p in paths.items():
                plan = write_plan(p, Path(tmp) / f"plan-{h}", past=32)
                report["counted"][h] = {
                    cpu: count_plan(CLASSES[cpu], build("plugin"), plan, 8, 2, args.arm64_root)
                    for cpu in args.cpu
                }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
