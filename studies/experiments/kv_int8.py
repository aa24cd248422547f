"""An int8 KV cache on stock onnxruntime: GroupQueryAttention's quantized cache against the
fp32 cache, and llama.cpp's q8_0 KV cache against its f16 cache, on the same token ids, same metric.

    python -m studies.experiments.kv_int8 --model-dir <converted folder> --gguf <the same model's GGUF>
        [--threads 1]
prints one JSON object.

What onnxruntime 1.32's CPU GroupQueryAttention offers: an int8 cache (`kv_cache_bit_width` 8, int8
past/present) with `k_quant_type`/`v_quant_type` PER_TENSOR or PER_CHANNEL (the schema has no other mode) and
the scales as graph inputs (`k_scale`/`v_scale`, fp32, [1] or [kv_heads, head_dim]). The kernel stores
clip(round(x / scale), -128, 127). One scale tensor covers the whole cache, so it cannot follow the tokens:
it is fixed before the first token (calibrated), unlike llama.cpp's q8_0, which keeps a scale per 32 values
of every token. `graph_block32` is that layout built from plain ops around an fp32 GroupQueryAttention.

Calibration here: the fp32 model's own greedy replies to the chat workload's prompts (no text of the
evaluation); per layer, the largest |K| and |V| per (kv head, channel), or per layer for PER_TENSOR.
Evaluation, both engines one token per forward pass:
- top-1 agreement: teacher-forced on the rewrite workload's prompts (chat template + the ~400-token minutes),
  the argmax next token with the quantized cache against the engine's own unquantized cache;
- greedy: the chat prompts' greedy continuations, tokens identical to the unquantized run before the first
  difference;
- decode speed after a 500-token prompt, interleaved rounds (a shared machine: read the ratios).

Measured on SmolLM2 q4-a8 (studies/results/experiments/kv-int8-shared-2026-12-01.json, 1437 positions):
llama.cpp q8_0 0.967 top-1, GroupQueryAttention's int8 cache 0.945 at best (1.2x decode at ctx 500, 0.25x KV
bytes), graph_block32 0.962 (0.71x decode). Neither reaches q8_0's agreement, so simmer has no int8 KV rung.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from bench.engine_probe import long_ids
from bench.workloads import workload_prompts
from models.runtime.session import DecoderSession, KVCache, ModelShape

N_CTX = 2048
GREEDY_TOKENS = 48
CALIBRATION_TOKENS = 64
EVAL_TASKS = ("rewrite",)  # one of the rewrite workload's prompts: about 480 positions
# GroupQueryAttention's modes: (kind, scale = calibrated max x margin / 127), K and V alike (the CPU kernel
# refuses k_quant_type != v_quant_type). On SmolLM2's rewrite prompt, per channel x1.0 / x1.5 and per tensor
# x0.7 did worse than these two (0.925, 0.937, 0.921 top-1; `--gqa PER_CHANNEL:1.0 PER_CHANNEL:1.5 ...`).
GQA_CONFIGS = ("PER_CHANNEL:2.0", "PER_TENSOR:1.0")


class TypedKV(KVCache):
    """KVCache in a given dtype (int8 for the quantized graph)."""

    def __init__(self, shape: ModelShape, capacity: int, dtype: Any) -> None:
        import onnxruntime as ort

        self.shape, self.capacity = shape, capacity
        dims = (1, shape.n_kv_heads, capacity, shape.head_dim)
        self.arrays = [(np.zeros(dims, dtype), np.zeros(dims, dtype)) for _ in range(shape.n_layers)]
        self.ortvalues = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays
        ]
        self.tokens = []


def quantized_graph(
    src: Path, dst: Path, name: str, scales: list[tuple[np.ndarray, np.ndarray]], kind: str
) -> Path:
    """A copy of the graph `src` whose caches are int8 with the given per-layer (k_scale, v_scale), as
    dst/<name>.onnx. onnxruntime refuses external data outside the graph's folder (a symlink too): the
    weights file is hard-linked there, or copied across file systems."""
    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == len(scales)
    for i, (node, (ks, vs)) in enumerate(zip(gqa, scales, strict=True)):
        names = [f"kv_int8.{i}.k_scale", f"kv_int8.{i}.v_scale"]
        g.initializer.extend(
            [numpy_helper.from_array(ks.astype(np.float32), names[0]), numpy_helper.from_array(vs, names[1])]
        )
        ins = list(node.input) + [""] * (12 - len(node.input))
        del node.input[:]
        node.input.extend(ins[:12] + names)
        node.attribute.extend(
            [
                onnx.helper.make_attribute("k_quant_type", kind),
                onnx.helper.make_attribute("v_quant_type", kind),
                onnx.helper.make_attribute("kv_cache_bit_width", 8),
            ]
        )
    for vi in [*g.input, *g.output]:
        if vi.name.startswith(("past_key_values.", "present.")):
            vi.type.tensor_type.elem_type = TensorProto.INT8
    _link_weights(src, dst)
    out = dst / f"{name}.onnx"
    onnx.save(model, str(out))
    return out


def _link_weights(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.parent.iterdir():
        if f.suffix == ".data" and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)


BLOCK = 32  # q8_0's block: one scale per 32 values of every token


def blockq_graph(src: Path, dst: Path, name: str, shape: ModelShape, block: int = BLOCK) -> Path:
    """The alternative to GroupQueryAttention's own int8 cache: the cache is int8 with an fp32 scale per 32
    values of every token (q8_0's layout), dequantized in the graph before a plain fp32 GroupQueryAttention
    (non-shared: past [1, kv_heads, P, head_dim] in, present P + S out) and the S new rows quantized after it.
    Inputs past_q.<i>.key|value (int8) and past_s.<i>.key|value ([1, kv_heads, P, head_dim / 32]); outputs
    new_q.<i>.* and new_s.<i>.* for the S new positions, which the caller appends to its buffers."""
    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    kvh, hd = shape.n_kv_heads, shape.head_dim
    if hd % block:
        raise ValueError(f"head_dim {hd} is not a multiple of the block {block}")
    nb = hd // block
    consts = {
        "bq.shape5": np.array([1, kvh, -1, nb, block], np.int64),
        "bq.shape4": np.array([1, kvh, -1, hd], np.int64),
        "bq.last": np.array([-1], np.int64),
        "bq.axis2": np.array([2], np.int64),
        "bq.big": np.array([1 << 30], np.int64),
        "bq.inv127": np.array(1 / 127, np.float32),
        "bq.tiny": np.array(1e-30, np.float32),
        "bq.lo": np.array(-127, np.float32),
        "bq.hi": np.array(127, np.float32),
    }
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    mk = onnx.helper.make_node
    info = onnx.helper.make_tensor_value_info
    nodes = []
    new_inputs, new_outputs = [], []
    layer = 0
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        post = []
        for j, kind in ((3, "key"), (4, "value")):
            p, q_in, s_in = f"bq.{layer}.{kind}", f"past_q.{layer}.{kind}", f"past_s.{layer}.{kind}"
            new_inputs += [info(q_in, TensorProto.INT8, [1, kvh, "past", hd])]
            new_inputs += [info(s_in, TensorProto.FLOAT, [1, kvh, "past", nb])]
            nodes += [
                mk("Cast", [q_in], [p + ".qf"], to=TensorProto.FLOAT),
                mk("Reshape", [p + ".qf", "bq.shape5"], [p + ".q5"]),
                mk("Unsqueeze", [s_in, "bq.last"], [p + ".s5"]),
                mk("Mul", [p + ".q5", p + ".s5"], [p + ".d5"]),
                mk("Reshape", [p + ".d5", "bq.shape4"], [p + ".past"]),
            ]
            node.input[j] = p + ".past"
            post += [
                mk("Shape", [q_in], [p + ".shp"]),
                mk("Gather", [p + ".shp", "bq.axis2"], [p + ".plen"], axis=0),
                mk("Slice", [f"present.{layer}.{kind}", p + ".plen", "bq.big", "bq.axis2"], [p + ".new"]),
                mk("Reshape", [p + ".new", "bq.shape5"], [p + ".n5"]),
                mk("Abs", [p + ".n5"], [p + ".abs"]),
                mk(
                    "ReduceMax", [p + ".abs"], [p + ".amax"], axes=[-1], keepdims=1
                ),  # opset 17: axes attribute
                mk("Mul", [p + ".amax", "bq.inv127"], [p + ".sc0"]),
                mk("Max", [p + ".sc0", "bq.tiny"], [p + ".sc"]),
                mk("Div", [p + ".n5", p + ".sc"], [p + ".x"]),
                mk("Round", [p + ".x"], [p + ".r"]),
                mk("Clip", [p + ".r", "bq.lo", "bq.hi"], [p + ".cl"]),
                mk("Cast", [p + ".cl"], [p + ".qi5"], to=TensorProto.INT8),
                mk("Reshape", [p + ".qi5", "bq.shape4"], [f"new_q.{layer}.{kind}"]),
                mk("Squeeze", [p + ".sc", "bq.last"], [f"new_s.{layer}.{kind}"]),
            ]
            new_outputs += [info(f"new_q.{layer}.{kind}", TensorProto.INT8, [1, kvh, "new", hd])]
            new_outputs += [info(f"new_s.{layer}.{kind}", TensorProto.FLOAT, [1, kvh, "new", nb])]
        nodes += [node, *post]
        layer += 1
    g.ClearField("node")
    g.node.extend(nodes)
    ins = [i for i in g.input if not i.name.startswith("past_key_values.")]
    outs = [o for o in g.output if not o.name.startswith("present.")]
    g.ClearField("input")
    g.input.extend(ins + new_inputs)
    g.ClearField("output")
    g.output.extend(outs + new_outputs)
    _link_weights(src, dst)
    out = dst / f"{name}.onnx"
    onnx.save(model, str(out))
    return out


class BlockQSession:
    """Runs a blockq_graph: int8 + per-block scale buffers, the past passed as contiguous copies of the
    first P positions (an experiment: a real engine would keep a token-major layout and skip the copy)."""

    def __init__(self, path: Path, shape: ModelShape, threads: int, block: int = BLOCK) -> None:
        import onnxruntime as ort

        from models.runtime.session import session_options

        self.sess = ort.InferenceSession(
            str(path), session_options(threads), providers=["CPUExecutionProvider"]
        )
        self.shape, self.block = shape, block
        self.out_names = [o.name for o in self.sess.get_outputs()]

    def new_cache(self, capacity: int) -> dict[str, np.ndarray]:
        s = self.shape
        cache = {}
        for i in range(s.n_layers):
            for kind in ("key", "value"):
                cache[f"q.{i}.{kind}"] = np.zeros((1, s.n_kv_heads, capacity, s.head_dim), np.int8)
                cache[f"s.{i}.{kind}"] = np.zeros(
                    (1, s.n_kv_heads, capacity, s.head_dim // self.block), np.float32
                )
        return cache

    def run(self, ids: np.ndarray, kv: dict[str, np.ndarray], past_len: int) -> np.ndarray:
        n = int(ids.shape[-1])
        feeds: dict[str, Any] = {
            "input_ids": ids.reshape(1, n).astype(np.int64),
            "attention_mask": np.ones((1, past_len + n), np.int64),
        }
        for name, buf in kv.items():
            feeds[f"past_{name}"] = np.ascontiguousarray(buf[:, :, :past_len])
        outs = dict(zip(self.out_names, self.sess.run(None, feeds), strict=True))
        for name, buf in kv.items():
            buf[:, :, past_len : past_len + n] = outs[f"new_{name}"]
        return np.asarray(outs["logits"])[0, -1]


def decode_all(sess: DecoderSession, kv: KVCache, ids: list[int]) -> np.ndarray:
    """Teacher-forced, one token per pass: the argmax after each of `ids`."""
    return np.array([int(np.argmax(sess.run(np.array([t]), kv, pos))) for pos, t in enumerate(ids)])


def greedy(sess: DecoderSession, kv: KVCache, ids: list[int], n: int) -> list[int]:
    for pos, t in enumerate(ids[:-1]):
        sess.run(np.array([t]), kv, pos)
    pos, tok, out = len(ids) - 1, ids[-1], []
    for _ in range(n):
        tok = int(np.argmax(sess.run(np.array([tok]), kv, pos)))
        out.append(tok)
        pos += 1
    return out


def calibrate(sess: DecoderSession, shape: ModelShape, prompts: list[list[int]]) -> dict[str, list]:
    """Per layer: max |K|, |V| per (kv head, channel) over the fp32 cache of the model's greedy replies."""
    k_max = np.zeros((shape.n_layers, shape.n_kv_heads, shape.head_dim), np.float32)
    v_max = np.zeros_like(k_max)
    for ids in prompts:
        kv = TypedKV(shape, len(ids) + CALIBRATION_TOKENS, np.float32)
        greedy(sess, kv, ids, CALIBRATION_TOKENS)
        n = len(ids) + CALIBRATION_TOKENS - 1
        for i, (k, v) in enumerate(kv.arrays):
            k_max[i] = np.maximum(k_max[i], np.abs(k[0, :, :n]).max(axis=1))
            v_max[i] = np.maximum(v_max[i], np.abs(v[0, :, :n]).max(axis=1))
    return {"k": list(k_max), "v": list(v_max)}


def scales_for(cal: dict[str, list], kind: str, margin: float) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for k, v in zip(cal["k"], cal["v"], strict=True):
        if kind == "PER_TENSOR":
            k, v = np.array([k.max()]), np.array([v.max()])
        out.append(((k * margin / 127).astype(np.float32), (v * margin / 127).astype(np.float32)))
    return out


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a == b).mean())


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def onnx_side(args: argparse.Namespace, evals: dict[str, list[int]], chats: dict[str, list[int]]) -> dict:
    manifest = json.loads((args.model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    src = args.model_dir / manifest["variants"][args.variant]["file"]
    base = DecoderSession(src, shape, args.threads)
    cal = calibrate(base, shape, list(chats.values()))

    def run(sess: Any, new_cache: Any) -> dict[str, Any]:
        tf = {name: decode_all(sess, new_cache(len(ids)), ids) for name, ids in evals.items()}
        gr = {
            name: greedy(sess, new_cache(len(ids) + GREEDY_TOKENS), ids, GREEDY_TOKENS)
            for name, ids in chats.items()
            if args.greedy
        }
        return {"tf": tf, "greedy": gr}

    def typed(dtype: Any) -> Any:
        return lambda capacity: TypedKV(shape, capacity, dtype)

    ref = run(base, typed(np.float32))
    configs: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="kv_int8_", dir=args.workdir))
    sessions = {}
    for kind, margin in (c.split(":") for c in args.gqa):
        name = f"gqa_{kind.lower()}_x{margin}"
        path = quantized_graph(src, tmp, name, scales_for(cal, kind, float(margin)), kind)
        sess = DecoderSession(path, shape, args.threads)
        configs[name] = summarize(ref, run(sess, typed(np.int8)))
        sessions[name] = sess
    best = max(configs, key=lambda n: configs[n]["top1_agreement"])
    bq = BlockQSession(blockq_graph(src, tmp, "block32", shape), shape, args.threads)
    configs["graph_block32"] = summarize(ref, run(bq, bq.new_cache))
    engines = [("fp32", base, typed(np.float32)), (best, sessions[best], typed(np.int8))]
    speed = speed_onnx([*engines, ("graph_block32", bq, bq.new_cache)], args.rounds) if args.rounds else None
    shutil.rmtree(tmp)  # the sessions keep their mappings
    per_elem = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim
    return {
        "variant": args.variant,
        "kv_bytes_per_token": {
            "fp32": shape.kv_bytes_per_token(),
            "gqa_int8": per_elem,
            "graph_block32": per_elem + per_elem // BLOCK * 4,
        },
        "calibration": {
            "tokens": sum(len(x) + CALIBRATION_TOKENS - 1 for x in chats.values()),
            "k_absmax_layer_max": [round(float(x.max()), 2) for x in cal["k"]],
            "v_absmax_layer_max": [round(float(x.max()), 2) for x in cal["v"]],
        },
        "configs": configs,
        "best_gqa": best,
        "speed_ctx500": speed,
    }


def summarize(ref: dict, got: dict) -> dict[str, Any]:
    agree = {n: agreement(ref["tf"][n], got["tf"][n]) for n in ref["tf"]}
    positions = sum(len(x) for x in ref["tf"].values())
    same = sum(int((ref["tf"][n] == got["tf"][n]).sum()) for n in ref["tf"])
    prefixes = {n: same_prefix(ref["greedy"][n], got["greedy"][n]) for n in ref["greedy"]}
    return {
        "top1_agreement": same / positions,
        "positions": positions,
        "top1_by_prompt": agree,
        "greedy_same_prefix": prefixes,
        "greedy_identical": sum(p == GREEDY_TOKENS for p in prefixes.values()),
        "greedy_prompts": len(prefixes),
    }


def speed_onnx(engines: list[tuple[str, Any, Any]], rounds: int) -> dict[str, Any]:
    """Decode after a 500-token prompt, the engines interleaved round by round."""
    ids = long_ids()
    times: dict[str, list[float]] = {name: [] for name, _, _ in engines}
    for _ in range(rounds):
        for name, sess, new_cache in engines:
            kv = new_cache(len(ids) + GREEDY_TOKENS)
            tok = int(np.argmax(sess.run(np.array(ids), kv, 0)))
            t0 = time.perf_counter()
            for j in range(GREEDY_TOKENS):
                tok = int(np.argmax(sess.run(np.array([tok]), kv, len(ids) + j)))
            times[name].append((time.perf_counter() - t0) / GREEDY_TOKENS)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "decode_ms_per_token": {k: round(v * 1e3, 3) for k, v in med.items()},
        "tok_s_over_fp32": {k: round(med["fp32"] / v, 3) for k, v in med.items()},
    }


def llama_side(args: argparse.Namespace, evals: dict[str, list[int]], chats: dict[str, list[int]]) -> dict:
    import llama_cpp

    def open_llm(type_kv: int | None, logits_all: bool) -> Any:
        extra: dict[str, Any] = {"type_k": type_kv, "type_v": type_kv} if type_kv is not None else {}
        return llama_cpp.Llama(
            str(args.gguf),
            n_ctx=1024 if logits_all else N_CTX,  # logits_all keeps n_ctx x vocab fp32 scores
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_batch=1 if logits_all else 512,
            n_ubatch=1 if logits_all else 512,
            logits_all=logits_all,
            flash_attn=True,  # a quantized V cache needs it; the f16 baseline uses it too
            verbose=False,
            **extra,
        )

    def run(type_kv: int | None) -> dict[str, Any]:
        llm = open_llm(type_kv, True)
        tf = {}
        for name, ids in evals.items():
            llm.reset()
            llm.eval(ids)
            tf[name] = np.asarray(llm.scores[: len(ids)]).argmax(-1)
        gr = {}
        for name, ids in chats.items() if args.greedy else ():
            llm.reset()
            llm.eval(ids)
            out = []
            for _ in range(GREEDY_TOKENS):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                out.append(tok)
                llm.eval([tok])
            gr[name] = out
        del llm
        return {"tf": tf, "greedy": gr}

    ref = run(None)
    q8 = run(8)  # GGML_TYPE_Q8_0
    speed = speed_llama(open_llm, args.rounds) if args.rounds else None
    return {"q8_0_vs_f16": summarize(ref, q8), "speed_ctx500": speed}


def speed_llama(open_llm: Any, rounds: int) -> dict[str, Any]:
    ids = long_ids()
    llms = {"f16": open_llm(None, False), "q8_0": open_llm(8, False)}
    times: dict[str, list[float]] = {k: [] for k in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            llm.reset()
            llm.eval(ids)
            n_vocab = llm.n_vocab()
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
            t0 = time.perf_counter()
            for _ in range(GREEDY_TOKENS):
                llm.eval([tok])
                tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
            times[name].append((time.perf_counter() - t0) / GREEDY_TOKENS)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "decode_ms_per_token": {k: round(v * 1e3, 3) for k, v in med.items()},
        "q8_0_over_f16_tok_s": med["f16"] / med["q8_0"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="int8 KV cache: onnxruntime against llama.cpp q8_0")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--variant", default="q4-a8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="speed rounds (0: no speed)")
    p.add_argument("--eval-tasks", nargs="+", default=list(EVAL_TASKS), help="rewrite workload prompts")
    p.add_argument("--no-greedy", dest="greedy", action="store_false")
    p.add_argument("--gqa", nargs="+", default=list(GQA_CONFIGS), help="KIND:MARGIN, e.g. PER_CHANNEL:2.0")
    p.add_argument("--only", choices=["onnxruntime", "llama.cpp"], help="run one side (default: both)")
    p.add_argument("--workdir", type=Path, help="where the int8 graphs go (default: the system's temp)")
    args = p.parse_args(argv)
    rewrite = workload_prompts(args.model_dir, "rewrite")
    evals = {name: rewrite[name] for name in args.eval_tasks}
    chats = workload_prompts(args.model_dir, "chat")
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True}
    }
    if args.only in (None, "onnxruntime"):
        out["onnxruntime"] = onnx_side(args, evals, chats)
    if args.only in (None, "llama.cpp"):
        out["llama.cpp"] = llama_side(args, evals, chats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
