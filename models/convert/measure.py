"""Measure a converted variant: quality against the fp32 reference, decode speed, and the memory it takes.

A model whose weights do not fit SEGMENT_BYTES is measured a segment at a time: the same graph cut into
consecutive layer ranges (GraphBuilder.build(segment)), over the very initializers of the variant's weights
file, each loaded, run over every position it is asked for and unloaded before the next. The hidden state
between segments is the graph's own (the normed input of the next layer and the residual stream), so the
logits are those of the whole graph (tests check it), while at most one segment's prepacked weights are
in memory: a whole session of Qwen2.5 1.5B's q4-a8 takes 1.9 GB, more than a phone lets a conversion
have. A model that fits is one segment: its own .onnx file.

Speed is measured the same way: each segment decodes the same tokens after a 128-token prefill, and a
token's time is the sum over segments (a few session calls more than the whole graph makes, ~0.1 ms each).
The memory figure (`load_rss_bytes`, what the server's memory planner starts from) is the sum of what
each segment added to RSS once loaded and run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil

from models.convert.graph import (
    SEGMENT_STATE,
    SEGMENT_STATE_OUT,
    GraphBuilder,
    Segment,
    VariantSpec,
    Weights,
)
from models.convert.heap import trim_heap
from models.convert.model import GGUFModel
from models.convert.quality import METHOD, Comparison
from models.runtime.session import (
    WEIGHTS_FILE,
    KVCache,
    ModelShape,
    graph_kv_dtype,
    release_copied,
    session_options,
)

# GGUF bytes of one measured segment: its weights prepacked take about twice that in memory
SEGMENT_BYTES = 160 << 20
SPEED_PROMPT = 128
SPEED_TOKENS = 48
SEGMENT_FILE = ".measure-{variant}-{index}.onnx"  # removed once measured: never part of an install


def layer_bytes(model: GGUFModel) -> list[int]:
    """The GGUF bytes of each layer's tensors."""
    sizes = [0] * model.config.n_layers
    for name in model.tensors:
        if name.startswith("blk."):
            sizes[int(name.split(".")[1])] += int(np.asarray(model.tensor(name).data).nbytes)
    return sizes


def plan_segments(model: GGUFModel, budget: int | None = None) -> list[Segment]:
    """Consecutive segments of at most `budget` GGUF bytes each (one layer at least); the LM head alone
    when the model is split (a vocabulary-sized head is the largest single piece); one segment, the whole
    graph, when everything fits."""
    budget = SEGMENT_BYTES if budget is None else budget
    n = model.config.n_layers
    head = "token_embd.weight" if model.config.tied_embeddings else "output.weight"
    sizes = layer_bytes(model)
    head_bytes = int(np.asarray(model.tensor(head).data).nbytes)
    if sum(sizes) + head_bytes <= budget:
        return [Segment(0, n, head=True)]
    segments, lo, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > lo and used + size > budget:
            segments.append(Segment(lo, i))
            lo, used = i, 0
        used += size
    segments.append(Segment(lo, n))
    return [*segments, Segment(n, n, head=True)]


def write_segments(
    model: GGUFModel, spec: VariantSpec, weights: Weights, out_dir: Path, segments: list[Segment]
) -> list[Path]:
    """The segment graphs of a variant just built into `weights` (open): every initializer they name is
    one the variant's graph wrote, so nothing is added to the file."""
    if len(segments) == 1:
        return [out_dir / f"{spec.name}.onnx"]
    size = weights.size
    paths = []
    for i, segment in enumerate(segments):
        path = out_dir / SEGMENT_FILE.format(variant=spec.name, index=i)
        path.write_bytes(GraphBuilder(model, spec, weights).build(segment).SerializeToString())
        paths.append(path)
    if weights.size != size:
        raise RuntimeError("converter bug: a segment graph wrote weights of its own")
    return paths


@dataclass
class _Pass:
    """What one segment hands the next: per position, its inputs (token ids for the first segment)."""

    quality: list[dict[str, np.ndarray]]  # per prompt: input name -> [positions, ...]
    speed: dict[str, np.ndarray]  # input name -> [SPEED_PROMPT + SPEED_TOKENS, ...]


class _SegmentSession:
    """One segment's session with a KV buffer for its layers, shared by past and present (as served)."""

    def __init__(
        self, path: Path, segment: Segment, shape: ModelShape, threads: int, copied: list[list[int]]
    ) -> None:
        self.segment = segment
        self.sess = ort.InferenceSession(
            str(path), session_options(threads), providers=["CPUExecutionProvider"]
        )
        release_copied(path.parent / WEIGHTS_FILE, copied)  # as served: those pages are not counted
        self.inputs = {i.name for i in self.sess.get_inputs()}
        self.outputs = [o.name for o in self.sess.get_outputs() if not o.name.startswith("present.")]
        self.shape = shape
        self._keep_one = ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int64))
        overridable = {i.name for i in self.sess.get_overridable_initializers()}
        self.keeps_logits = "num_logits_to_keep" in self.inputs | overridable

    def new_kv(self, capacity: int) -> KVCache:
        layers = self.segment.hi - self.segment.lo
        # the segment's own KV type, so a half cache's error is in what is measured
        kv = graph_kv_dtype(self.sess, f"past_key_values.{self.segment.lo}.key") if layers else "float32"
        return KVCache(ModelShape(layers, self.shape.n_kv_heads, self.shape.head_dim, 1, kv), capacity)

    def run(self, feeds: dict[str, np.ndarray], kv: KVCache, past_len: int) -> dict[str, np.ndarray]:
        n = next(iter(feeds.values())).shape[-2 if "input_ids" not in feeds else -1]
        b = self.sess.io_binding()
        for name, value in feeds.items():
            if name in self.inputs:  # the head takes the normed state alone
                b.bind_cpu_input(name, np.ascontiguousarray(value))
        if "attention_mask" in self.inputs:
            b.bind_cpu_input("attention_mask", np.ones((1, past_len + n), np.int64))
        if self.keeps_logits:
            b.bind_ortvalue_input("num_logits_to_keep", self._keep_one)
        for name in self.outputs:  # first: outputs come back in the order they were bound
            b.bind_output(name, "cpu")
        for j, (k, v) in enumerate(kv.ortvalues):
            i = self.segment.lo + j
            b.bind_ortvalue_input(f"past_key_values.{i}.key", k)
            b.bind_ortvalue_input(f"past_key_values.{i}.value", v)
            b.bind_ortvalue_output(f"present.{i}.key", k)
            b.bind_ortvalue_output(f"present.{i}.value", v)
        self.sess.run_with_iobinding(b)
        outputs = b.get_outputs()
        return {name: outputs[i].numpy() for i, name in enumerate(self.outputs)}


def _feeds(state: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
    if "input_ids" in state:
        return {"input_ids": state["input_ids"][lo:hi].reshape(1, hi - lo)}
    return {name: value[lo:hi] for name, value in state.items()}


def _next_state(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: out[o] for name, o in zip(SEGMENT_STATE, SEGMENT_STATE_OUT, strict=True) if o in out}


def measure_variant(
    paths: list[Path],
    segments: list[Segment],
    shape: ModelShape,
    prompts: list[list[int]],
    ref_logits: list[np.ndarray],
    threads: int,
    copied_at_load: list[list[int]] | None = None,
    speed_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Quality (token by token, through the KV path: KL and top-1 against the reference, models/convert/
    quality.py), decode speed and memory of a variant, a segment at a time (`paths[i]` holds
    `segments[i]`). Each position's logits are compared as they come: a vocabulary's worth per position
    is never kept. Without prompts, speed (after `speed_ids`) and memory alone."""
    proc = psutil.Process()
    seqs = [np.asarray(ids[: len(ref)], np.int64) for ids, ref in zip(prompts, ref_logits, strict=True)]
    source = np.concatenate(seqs) if seqs else np.asarray(speed_ids or [1], np.int64)
    tokens = np.resize(source, SPEED_PROMPT + SPEED_TOKENS)
    state = _Pass([{"input_ids": s} for s in seqs], {"input_ids": tokens})
    comparison, errors = Comparison(), []
    load_s = wall = cpu = 0.0
    load_rss = 0
    for path, segment in zip(paths, segments, strict=True):
        gc.collect()
        trim_heap()
        rss0 = proc.memory_info().rss
        t0 = time.perf_counter()
        sess = _SegmentSession(path, segment, shape, threads, copied_at_load or [])
        load_s += time.perf_counter() - t0
        quality = []
        for seq_state, ref in zip(state.quality, ref_logits, strict=True):
            kv = sess.new_kv(len(next(iter(seq_state.values()))))
            outs = []
            for pos in range(kv.capacity):
                out = sess.run(_feeds(seq_state, pos, pos + 1), kv, pos)
                if segment.head:
                    logits = out["logits"].reshape(-1)
                    comparison.add(ref[pos], logits)
                    errors.append(float(np.abs(logits - ref[pos]).max()))
                else:
                    outs.append(out)
            if outs:
                quality.append({k: np.concatenate([o[k] for o in outs]) for k in outs[0]})
        kv = sess.new_kv(SPEED_PROMPT + SPEED_TOKENS)
        prefill = sess.run(_feeds(state.speed, 0, SPEED_PROMPT), kv, 0)
        steps = []
        c0, t1 = time.process_time(), time.perf_counter()
        for pos in range(SPEED_PROMPT, SPEED_PROMPT + SPEED_TOKENS):
            steps.append(sess.run(_feeds(state.speed, pos, pos + 1), kv, pos))
        wall, cpu = wall + time.perf_counter() - t1, cpu + time.process_time() - c0
        load_rss += max(0, proc.memory_info().rss - rss0)
        if not segment.head:
            state = _Pass(
                [_next_state(q) for q in quality],
                {k: np.concatenate([prefill[o], *(s[o] for s in steps)]) for k, o in _state_names(prefill)},
            )
        del sess, kv, prefill, steps
    result: dict[str, Any] = {
        "speed": {
            "decode_tok_s": round(SPEED_TOKENS / wall, 2),
            "cpu_s_per_token": round(cpu / SPEED_TOKENS, 5),
            "threads": threads,
            "context": SPEED_PROMPT + SPEED_TOKENS,
            "load_s": round(load_s, 3),
            "segments": len(segments),
        },
        "memory": {"load_rss_bytes": load_rss},
    }
    if errors:
        result["quality"] = comparison.summary(METHOD.format(n=len(errors))) | {
            "max_logit_error": round(max(errors), 6),
            "mean_logit_error": round(float(np.mean(errors)), 6),
        }
    return result


def _state_names(out: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    return [(name, o) for name, o in zip(SEGMENT_STATE, SEGMENT_STATE_OUT, strict=True) if o in out]
