"""Two ways to bring simmer's peak RSS toward llama.cpp's on stock onnxruntime, timed against what they cost.

    python -m studies.experiments.memory_routes [--rounds 3] [--threads 2] [--models smollm2,gemma3,...]
prints one JSON object.

- **One copy of a tied table** (`head`). Today a tied vocabulary table is resident twice: MatMulNBits packs
  the head into its own layout (8-bit codes, fp32 scales and block sums per 32) and the lookup gathers rows
  from the file's codes. A head whose int8 table is not a constant initializer is never packed, so the head
  and the lookup could read one copy: `packed` is today's head (MatMulNBits, 8 bits, block 32, int8
  activations), `unpacked` the same table [hidden, vocab] as DynamicQuantizeMatMul's B fed at run time
  (per-vocab-row scales). Each in its own process: milliseconds a call for one row, and the RSS the
  session adds over the table's own bytes.
- **An fp16 KV cache** (`kv`): one GroupQueryAttention layer of each model's shape with its past and present
  in one buffer (as the engine binds them), fp32 against fp16 (Casts around the node), at past 16, 500 and
  2,000: microseconds a call, so the ms a token costs over the model's layers, beside the MB it saves at a
  2,048-token context.

Random weights and activations: these are timings and sizes, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_probe import rss
from models.runtime.session import session_options

# name: (vocab, hidden, heads, kv heads, head_dim, layers)
SHAPES = {
    "smollm2": (49152, 576, 9, 3, 64, 30),
    "gemma3": (262144, 640, 4, 1, 256, 18),
    "qwen-0.5b": (151936, 896, 14, 2, 64, 24),
    "qwen-1.5b": (151936, 1536, 12, 2, 128, 28),
}
PASTS = (16, 500, 2000)
N_CTX = 2048
BLOCK = 32


def head_model(route: str, vocab: int, hidden: int, seed: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """(ONNX model, run-time feeds other than A) of one head route over the same int8 table."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    table = rng.integers(-127, 128, (vocab, hidden), dtype=np.int8)
    scale = ((rng.random(vocab) + 0.5) * 0.01).astype(np.float32)
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, hidden])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, vocab])
    feeds: dict[str, np.ndarray] = {}
    if route == "packed":
        blocks = hidden // BLOCK
        inits = [
            numpy_helper.from_array(
                (table.astype(np.int16) + 128).astype(np.uint8).reshape(vocab, blocks, BLOCK), "B"
            ),
            numpy_helper.from_array(np.repeat(scale[:, None], blocks, 1).reshape(-1), "S"),
            numpy_helper.from_array(np.full(vocab * blocks, 128, np.uint8), "Z"),
        ]
        node = helper.make_node(
            "MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft",
            K=hidden, N=vocab, bits=8, block_size=BLOCK, accuracy_level=4,
        )  # fmt: skip
        inputs = [a]
    elif route == "unpacked":
        feeds["B"] = np.ascontiguousarray(table.T)  # the lookup would gather its columns
        inits = [numpy_helper.from_array(scale, "S"), numpy_helper.from_array(np.zeros(vocab, np.int8), "Z")]
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft")
        inputs = [a, helper.make_tensor_value_info("B", TensorProto.INT8, [hidden, vocab])]
    else:
        raise ValueError(route)
    graph = helper.make_graph([node], "head", inputs, [y], inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    return model, feeds


def u8s8_saturates() -> bool:
    """Whether this CPU's DynamicQuantizeMatMul (uint8 activations x int8 weights) saturates: on x86 without
    VNNI, MLAS sums pairs of products in int16 (vpmaddubsw; onnxruntime's quantization docs say so), and
    255 * 127 * 2 does not fit. Measured: [1, 1] @ [127, 127] must be 254; saturated it is 128.5. Where
    it saturates the `unpacked` head computes other numbers than the packed one, and its timings compare
    different work."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "S"], ["Y"], domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "saturation",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1])],
        [
            numpy_helper.from_array(np.full((2, 1), 127, np.int8), "B"),
            numpy_helper.from_array(np.ones(1, np.float32), "S"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = np.asarray(sess.run(None, {"A": np.ones((1, 2), np.float32)})[0])
    return bool(abs(float(y.reshape(-1)[0]) - 254.0) > 1.0)


def head_probe(route: str, vocab: int, hidden: int, threads: int, calls: int) -> dict[str, Any]:
    """One head route in this process: RSS the session adds (the initializers mapped from a file, as the
    engine loads them) and ms a call."""
    import onnx
    import onnxruntime as ort

    model, feeds = head_model(route, vocab, hidden)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "head.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location="head.data", size_threshold=0)
        del model
        before = rss()
        sess = ort.InferenceSession(
            str(path), session_options(threads, spinning=True), providers=["CPUExecutionProvider"]
        )
        session_mb = (rss() - before) / 1e6
        a = np.random.default_rng(1).standard_normal((1, hidden)).astype(np.float32)
        for _ in range(3):
            sess.run(None, {"A": a, **feeds})
        t0 = time.perf_counter()
        for _ in range(calls):
            sess.run(None, {"A": a, **feeds})
        ms = (time.perf_counter() - t0) / calls * 1000
    return {"route": route, "ms_per_call": round(ms, 3), "session_rss_mb": round(session_mb, 1),
            "fed_table_mb": round(sum(f.nbytes for f in feeds.values()) / 1e6, 1)}  # fmt: skip


def gqa_model(heads: int, kv_heads: int, head_dim: int, fp16: bool) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    kv_type = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    width = (heads + 2 * kv_heads) * head_dim
    cache = [1, kv_heads, N_CTX, head_dim]
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(N_CTX), inv)
    dtype = np.float16 if fp16 else np.float32
    inits = [
        numpy_helper.from_array(np.cos(angles).astype(dtype), "cos"),
        numpy_helper.from_array(np.sin(angles).astype(dtype), "sin"),
    ]
    nodes = []
    qkv = "qkv"
    if fp16:
        nodes.append(helper.make_node("Cast", ["qkv"], ["qkv16"], to=TensorProto.FLOAT16))
        qkv = "qkv16"
    out = "o16" if fp16 else "o"
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", "past_key", "past_value", "seqlens_k", "total_len", "cos", "sin"],
            [out, "present_key", "present_value"],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            do_rotary=1,
        )
    )
    if fp16:
        nodes.append(helper.make_node("Cast", ["o16"], ["o"], to=TensorProto.FLOAT))
    inputs = [
        helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, width]),
        helper.make_tensor_value_info("past_key", kv_type, cache),
        helper.make_tensor_value_info("past_value", kv_type, cache),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
    ]
    outputs = [
        helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, 1, heads * head_dim]),
        helper.make_tensor_value_info("present_key", kv_type, cache),
        helper.make_tensor_value_info("present_value", kv_type, cache),
    ]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def gqa_session(shape: tuple[int, ...], fp16: bool, threads: int) -> tuple[Any, Any, np.ndarray, list]:
    """A session, its binding with one KV buffer as past and present (the engine's shared-buffer mode),
    the qkv input and the [k, v] arrays."""
    import onnxruntime as ort

    _, _, heads, kv_heads, head_dim, _ = shape
    sess = ort.InferenceSession(
        gqa_model(heads, kv_heads, head_dim, fp16).SerializeToString(),
        session_options(threads, spinning=True),
        providers=["CPUExecutionProvider"],
    )
    rng = np.random.default_rng(2)
    dtype = np.float16 if fp16 else np.float32
    kv = [rng.standard_normal((1, kv_heads, N_CTX, head_dim)).astype(dtype) for _ in range(2)]
    qkv = rng.standard_normal((1, 1, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    b = sess.io_binding()
    b.bind_output("o")  # first: gqa_call reads outputs[0]
    for name, arr in zip(("key", "value"), kv, strict=True):
        ov = ort.OrtValue.ortvalue_from_numpy(arr)
        b.bind_ortvalue_input(f"past_{name}", ov)
        b.bind_ortvalue_output(f"present_{name}", ov)
    b.bind_cpu_input("qkv", qkv)
    return sess, b, qkv, kv


def gqa_call(sess: Any, b: Any, past: int) -> np.ndarray:
    b.bind_cpu_input("seqlens_k", np.array([past], np.int32))
    b.bind_cpu_input("total_len", np.array(past + 1, np.int32))
    sess.run_with_iobinding(b)
    return b.get_outputs()[0].numpy()


def kv_probe(shape: tuple[int, ...], threads: int, calls: int, rounds: int) -> dict[str, Any]:
    """us a call of one layer's attention at each past length, fp32 and fp16 caches, rounds interleaved."""
    sessions = {fp16: gqa_session(shape, fp16, threads) for fp16 in (False, True)}
    times: dict[tuple[bool, int], list[float]] = {}
    for _ in range(rounds):
        for past in PASTS:
            for fp16, (sess, b, _, _) in sessions.items():
                for _ in range(3):
                    gqa_call(sess, b, past)
                t0 = time.perf_counter()
                for _ in range(calls):
                    gqa_call(sess, b, past)
                times.setdefault((fp16, past), []).append((time.perf_counter() - t0) / calls * 1e6)
    _, _, _, kv_heads, head_dim, layers = shape
    saved = 2 * layers * kv_heads * head_dim * 2 * N_CTX / 1e6  # fp32 -> fp16 halves 4 bytes a value
    out: dict[str, Any] = {"kv_mb_saved_at_2048": round(saved, 1), "layers": layers, "by_past": {}}
    for past in PASTS:
        f32 = statistics.median(times[(False, past)])
        f16 = statistics.median(times[(True, past)])
        out["by_past"][str(past)] = {
            "us_fp32": round(f32, 1),
            "us_fp16": round(f16, 1),
            "ms_per_token_added": round((f16 - f32) * layers / 1000, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--head-probe", default=None, help=argparse.SUPPRESS)  # one process's head measurement
    args = ap.parse_args()
    if args.head_probe:
        route, vocab, hidden = args.head_probe.split(":")
        print(json.dumps(head_probe(route, int(vocab), int(hidden), args.threads, args.calls)))
        return
    import onnxruntime as ort

    report: dict[str, Any] = {
        "experiment": "memory_routes",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "arch": platform.machine(), "onnxruntime": ort.__version__},
        "unpacked_head_saturates": u8s8_saturates(),
        "threads": args.threads,
        "rounds": args.rounds,
        "models": {},
    }
    for name in args.models.split(","):
        shape = SHAPES[name]
        vocab, hidden = shape[0], shape[1]
        runs: dict[str, list[dict[str, Any]]] = {"packed": [], "unpacked": []}
        for _ in range(args.rounds):
            for route in runs:
                cmd = [
                    sys.executable,
                    "-m",
                    "studies.experiments.memory_routes",
                    "--threads",
                    str(args.threads),
                ]
                cmd += ["--calls", str(args.calls), "--head-probe", f"{route}:{vocab}:{hidden}"]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[route].append(json.loads(done.stdout.strip().splitlines()[-1]))
        head = {
            route: {
                "ms_per_call": statistics.median(r["ms_per_call"] for r in rs),
                "session_rss_mb": statistics.median(r["session_rss_mb"] for r in rs),
                "fed_table_mb": rs[0]["fed_table_mb"],
            }
            for route, rs in runs.items()
        }
        head["unpacked_time_ratio"] = round(
            head["unpacked"]["ms_per_call"] / head["packed"]["ms_per_call"], 2
        )
        report["models"][name] = {
            "shape": dict(
                zip(("vocab", "hidden", "heads", "kv_heads", "head_dim", "layers"), shape, strict=True)
            ),
            "head": head,
            "kv": kv_probe(shape, args.threads, args.calls * 5, args.rounds),
        }
        print(json.dumps({name: report["models"][name]}), file=sys.stderr)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
