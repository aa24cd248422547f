"""Memory and speed of a vocabulary-sized table: the embedding lookup and the LM head of a real GGUF,
built by the converter's own embedding.py into a standalone graph, each layout measured in its own process.

    python -m studies.experiments.table_memory GGUF [--threads 2] [--rounds 5]

Gemma 3 270M's tied token_embd (262,144 x 640, Q8_0, 168 MB) is larger than all its layers together, and
the architecture needs no support for this: only the table is read. Per layout: resident memory (RSS) before
the session, after loading it, and after a few decode steps (a lookup of a few tokens + the head), and the
head's time per decoded token, rounds interleaved across processes so drift on a shared machine hits
every layout alike. Prints one JSON object per layout and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

LAYOUTS = {
    # name: (variant, how the head runs)
    "q4-a8: 8-bit head on the lookup's codes (int8 act)": ("q4-a8", "tied"),
    "q4: nibble-pair head (fp32 act, exact)": ("q4", "tied"),
    "fp32 head (the f32 variant's, or q4 with fp32 MatMul)": ("f32", "tied"),
    "q4-a8, lookup and head sharing one initializer": ("q4-a8", "shared"),
}
TOKENS = [2, 818, 5279, 529, 7001, 563]  # a few ids: BOS and ordinary words


class GGUFTensors:
    """Enough of GGUFModel for embedding.py and linear.py: tensors of any architecture, read straight from
    the file (the architecture itself need not be supported)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        table = self.tensor("token_embd.weight")
        self.config = SimpleNamespace(vocab=table.rows, hidden=table.cols, tied_embeddings=True)

    def tensor(self, name: str):
        from models.gguf.reader import SUPPORTED_TYPES, Tensor

        t = self.tensors[name]
        cols, rows = (int(x) for x in t.shape)
        return Tensor(name, SUPPORTED_TYPES[t.tensor_type], rows, cols, np.asarray(t.data))


def build(gguf: Path, out: Path) -> None:
    """One weights file, one .onnx per layout: input_ids -> rows, last [1, hidden] -> logits."""
    from onnx import TensorProto, helper

    from models.convert.embedding import embed_tokens, lm_head
    from models.convert.graph import OPSET, VARIANTS, GraphBuilder, WeightFile
    from models.convert.linear import MS

    model = GGUFTensors(gguf)
    weights = WeightFile(out / "weights.data")
    for i, (variant, head) in enumerate(LAYOUTS.values()):
        g = GraphBuilder(model, VARIANTS[variant], weights)
        rows, packed = embed_tokens(g)
        lm_head(g, "last", packed)
        if head == "shared":  # the layout commit ddc5b3e replaced: the lookup reads the head's initializer
            lookup = next(n for n in g.nodes if n.op_type == "GatherBlockQuantized")
            del g.inits[lookup.input[0]]
            lookup.input[0] = "token_embd.qweight"
        graph = helper.make_graph(
            g.nodes,
            "table",
            [
                helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]),
                helper.make_tensor_value_info("last", TensorProto.FLOAT, [1, model.config.hidden]),
            ],
            [
                helper.make_tensor_value_info(rows, TensorProto.FLOAT, None),
                helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
            ],
            list(g.inits.values()),
        )
        m = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)]
        )
        m.ir_version = 8
        (out / f"layout{i}.onnx").write_bytes(m.SerializeToString())
    weights.close()


def probe(path: Path, threads: int, steps: int) -> dict:
    """In a fresh process: RSS around loading and a few decode steps, and the head's time per step."""
    import psutil

    from models.runtime.session import session_options

    proc = psutil.Process()
    import onnxruntime as ort

    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    sess = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - t0
    rss_load = proc.memory_info().rss
    rng = np.random.default_rng(0)
    hidden = next(i for i in sess.get_inputs() if i.name == "last").shape[1]
    times = []
    for i in range(steps):
        ids = np.array([TOKENS[: 1 + i % len(TOKENS)]], np.int64)
        last = rng.standard_normal((1, hidden)).astype(np.float32)
        t = time.perf_counter()
        sess.run(None, {"input_ids": ids, "last": last})
        times.append(time.perf_counter() - t)
    rss_run = proc.memory_info().rss
    return {
        "rss_before_mb": round(rss0 / 2**20, 1),
        "load_mb": round((rss_load - rss0) / 2**20, 1),
        "after_steps_mb": round((rss_run - rss0) / 2**20, 1),
        "step_ms": round(statistics.median(times[1:]) * 1000, 2),
        "load_s": round(load_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path, nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        print(json.dumps(probe(a.probe, a.threads, a.steps)))
        return
    with tempfile.TemporaryDirectory(prefix="table-") as tmp:
        out = Path(tmp)
        build(a.gguf, out)
        results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        for r in range(a.rounds):
            names = list(LAYOUTS)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                i = list(LAYOUTS).index(name)
                cmd = [
                    sys.executable,
                    "-m",
                    "studies.experiments.table_memory",
                    "--probe",
                    str(out / f"layout{i}.onnx"),
                ]
                cmd += ["--threads", str(a.threads), "--steps", str(a.steps)]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                results[name].append(res)
                print(json.dumps({"layout": name, "round": r, **res}), file=sys.stderr, flush=True)
        print(f"\n{a.gguf.name}: table layouts, {a.threads} threads, medians of {a.rounds} processes")
        print(f"| layout | RSS at load (MB) | after {a.steps} steps (MB) | per step (ms) |")
        print("|---|---|---|---|")
        for name, rs in results.items():
            med = {k: statistics.median(x[k] for x in rs) for k in ("load_mb", "after_steps_mb", "step_ms")}
            print(f"| {name} | {med['load_mb']:.0f} | {med['after_steps_mb']:.0f} | {med['step_ms']:.1f} |")


if __name__ == "__main__":
    main()
