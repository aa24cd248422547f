"""Cut a variant's decode graph into one-node graphs, one per kind of node, for `cpu-cost --by-op`.

onnxruntime's wheels are stripped, so a count cannot be split by symbol; it can be split by operator. The
graph cut from is the one onnxruntime runs: the variant's file optimized with the engine's own session
options (fusions such as Sigmoid+Mul into QuickGelu happen there), saved by onnxruntime. One decode step
(one token, a past of `past` positions) runs through it here, natively, with every intermediate value
kept. Nodes of the same operator, attributes, weight role (the initializer's name without its `blk.<n>.`)
and input shapes are one kind; its first node becomes a one-node graph holding the node's own initializers
(so onnxruntime prepacks them as it does in the whole graph) and fed the values it saw in that step.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LAYER = re.compile(r"^blk\.\d+\.")
WHOLE = "whole decode step"
OVERHEAD = "run overhead"


@dataclass(frozen=True)
class Kind:
    key: str  # operator, attributes, weight roles, input shapes: what makes two nodes the same work
    label: str  # short: the operator and its weight's role, or its first input's shape
    nodes: tuple[str, ...]  # the names of the nodes of this kind, in graph order


def optimized(onnx_path: Path, into: Path) -> Any:
    """The graph as onnxruntime runs it with the engine's session options (one thread)."""
    import onnx
    import onnxruntime as ort

    from models.runtime.session import session_options

    so = session_options(1)
    out = into / "optimized.onnx"
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(out))


def decode_feed(model: Any, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step's inputs: one token after `past` positions; the past keys and values random (their
    values do not change which instructions run)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        t = inp.type.tensor_type
        dtype = np.dtype(tensor_dtype_to_np_dtype(t.elem_type))
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        if inp.name == "input_ids":
            feed[inp.name] = np.array([[300]], dtype=dtype)
        elif inp.name == "attention_mask":
            feed[inp.name] = np.ones((1, past + 1), dtype=dtype)
        elif inp.name.startswith("past_key_values."):
            shape = [1 if d == "batch" else past if isinstance(d, str) else d for d in dims]
            feed[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif inp.name == "num_logits_to_keep":
            feed[inp.name] = np.ones([1] * len(dims), dtype=dtype)
        else:
            raise ValueError(f"no decode value for the graph input {inp.name!r}")
    return feed


def capture(model: Any, feed: dict[str, np.ndarray], into: Path) -> dict[str, np.ndarray]:
    """Every value of one run of `model` on `feed`: its inputs, initializers' names excluded."""
    import onnx
    import onnxruntime as ort

    from models.runtime.session import session_options

    graph_outputs = {o.name for o in model.graph.output}
    names = [o for n in model.graph.node for o in n.output if o and o not in graph_outputs]
    typed = {v.name: v for v in model.graph.value_info}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in names:  # onnxruntime infers the type of the few it saved none for (shape arithmetic)
        probe.graph.output.append(typed.get(name) or onnx.helper.make_empty_tensor_value_info(name))
    path = into / "probe.onnx"
    onnx.save(probe, str(path), save_as_external_data=True, location="probe.data", size_threshold=1024)
    so = session_options(1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized already
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    values = {n: np.asarray(v) for n, v in zip(out_names, sess.run(out_names, feed), strict=True)}
    return {**feed, **values}


def constants(model: Any) -> dict[str, Any]:
    """The initializers a step cannot override: one that is also a graph input (a default) is fed."""
    fed = {i.name for i in model.graph.input}
    return {t.name: t for t in model.graph.initializer if t.name not in fed}


def role(name: str) -> str:
    return LAYER.sub("", name)


def attributes(node: Any) -> str:
    from onnx.helper import get_attribute_value

    def plain(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v if isinstance(v, int | float | str) else str(v)

    return json.dumps({a.name: plain(get_attribute_value(a)) for a in node.attribute}, sort_keys=True)


def kinds(model: Any, values: dict[str, np.ndarray]) -> list[Kind]:
    """The graph's nodes grouped into kinds (first seen first)."""
    inits = constants(model)
    groups: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for i, node in enumerate(model.graph.node):
        node_name = node.name or f"{node.op_type}_{i}"
        parts = []
        for name in node.input:
            if not name:
                parts.append("-")
            elif name in inits:
                parts.append(f"{role(name)}:{list(inits[name].dims)}")
            else:
                parts.append(f"{values[name].dtype}{list(values[name].shape)}")
        key = f"{node.domain or 'ai.onnx'}.{node.op_type} {attributes(node)} ({', '.join(parts)})"
        groups.setdefault(key, []).append(node_name)
        if key not in labels:
            weights = [role(n).split(".")[0] for n in node.input if n in inits and inits[n].dims]
            first = next((p for p in parts if p != "-"), "")
            labels[key] = f"{node.op_type} {weights[0] if weights else first}"
    return [Kind(key, labels[key], tuple(nodes)) for key, nodes in groups.items()]


def one_node(model: Any, node_name: str, values: dict[str, np.ndarray]) -> tuple[Any, dict[str, np.ndarray]]:
    """A graph of `node_name` alone: its initializers as initializers, its other inputs fed."""
    from onnx import helper, numpy_helper

    index = {n.name or f"{n.op_type}_{i}": n for i, n in enumerate(model.graph.node)}
    node = index[node_name]
    inits = constants(model)
    feed = {n: values[n] for n in node.input if n and n not in inits}
    graph = helper.make_graph(
        [node],
        "one_node",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feed.items()
        ],
        [
            helper.make_tensor_value_info(
                o, helper.np_dtype_to_tensor_dtype(values[o].dtype), values[o].shape
            )
            for o in node.output
            if o
        ],
        [
            numpy_helper.from_array(numpy_helper.to_array(inits[n]), n)
            for n in dict.fromkeys(node.input)
            if n in inits
        ],
    )
    cut = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return cut, feed


def overhead_graph() -> tuple[Any, dict[str, np.ndarray]]:
    """An Identity of one float: a run's cost with (almost) no kernel work, subtracted from every kind's."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "overhead",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), {
        "x": np.ones(1, np.float32)
    }


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz of named inputs (op_guest.py binds them by name)."""
    named: dict[str, Any] = dict(arrays)
    np.savez(path, **named)


def out_spec(value: np.ndarray) -> dict[str, Any]:
    return {"shape": list(value.shape), "dtype": str(value.dtype)}


def write_entry(
    into: Path,
    entries: list[dict[str, Any]],
    name: str,
    label: str,
    calls: int,
    graph: Any,
    *,
    feed: dict[str, np.ndarray],
    values: dict[str, np.ndarray],
    key: str | None = None,
) -> None:
    """One plan entry: `graph` (its weights in a file beside it), its inputs in an .npz, and its outputs'
    shapes and types (from `values`: what they were in the whole step) for op_guest.py to bind."""
    import onnx

    file = f"{len(entries):02d}-{name}"
    onnx.save(graph, str(into / f"{file}.onnx"), save_as_external_data=True, location=f"{file}.data")
    save_arrays(into / f"{file}.npz", feed)
    outputs = {o.name: out_spec(values[o.name]) for o in graph.graph.output}
    entry = {"label": label, "key": key or label, "calls_per_token": calls, "file": file, "outputs": outputs}
    entries.append(entry)


def write_plan(onnx_path: Path, into: Path, past: int = 32, whole: bool = True) -> Path:
    """Cut `onnx_path`'s decode graph into `into`: one .onnx and .npz per kind, the run overhead's, the
    optimized whole graph (when `whole`) and plan.json listing them with their calls per token."""
    into.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cut-", dir=into) as tmp:
        model = optimized(onnx_path, Path(tmp))
        feed = decode_feed(model, past)
        values = capture(model, feed, Path(tmp))
        graph, inputs = overhead_graph()
        write_entry(into, entries, "overhead", OVERHEAD, 0, graph, feed=inputs, values={"y": inputs["x"]})
        for i, kind in enumerate(kinds(model, values)):
            graph, inputs = one_node(model, kind.nodes[0], values)
            write_entry(
                into,
                entries,
                f"kind{i}",
                kind.label,
                len(kind.nodes),
                graph,
                feed=inputs,
                values=values,
                key=kind.key,
            )
        if whole:
            write_entry(into, entries, "whole", WHOLE, 1, model, feed=feed, values=values)
    plan = into / "plan.json"
    plan.write_text(json.dumps({"source": str(onnx_path), "past": past, "entries": entries}, indent=1))
    return plan


def per_call(marks: list[int], calls: list[int], entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The op guest's markers (three per entry: after a warm run, after `calls[i]` runs, after as many
    more) as instructions per call, net of the run overhead's (the first entry's)."""
    entries = list(entries)
    if len(marks) != 3 * len(entries) or len(calls) != len(entries) or min(calls) < 1:
        raise ValueError(f"expected {3 * len(entries)} markers for {len(entries)} entries, got {len(marks)}")
    raw = [(marks[3 * i + 2] - marks[3 * i + 1]) / calls[i] for i in range(len(entries))]
    first = [(marks[3 * i + 1] - marks[3 * i]) / calls[i] for i in range(len(entries))]
    overhead = raw[0]
    return [
        {
            **e,
            "insns_per_call_raw": round(r),
            "insns_per_call_first_half": round(f),
            "insns_per_call": round(r - overhead),
        }
        for e, r, f in zip(entries, raw, first, strict=True)
    ]


def by_op(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: instructions per call and per token, and share of the whole step; the sum's coverage."""
    whole = next((m for m in measured if m["label"] == WHOLE), None)
    overhead = next(m for m in measured if m["label"] == OVERHEAD)
    ops = []
    for m in measured:
        if m["label"] in (WHOLE, OVERHEAD):
            continue
        per_token = m["insns_per_call"] * m["calls_per_token"]
        ops.append(
            {
                "op": m["label"],
                "key": m["key"],
                "insns_per_call": m["insns_per_call"],
                # the first N calls' mean, raw: beside the last N's, how steady a kind's count is
                "insns_per_call_first_half_raw": m["insns_per_call_first_half"],
                "calls_per_token": m["calls_per_token"],
                "insns_per_token": per_token,
                "share_of_step": round(per_token / whole["insns_per_call_raw"], 4) if whole else None,
            }
        )
    ops.sort(key=lambda o: -o["insns_per_token"])
    total = sum(o["insns_per_token"] for o in ops)
    out: dict[str, Any] = {
        "run_overhead_insns": overhead["insns_per_call_raw"],
        "sum_of_ops_insns_per_token": total,
        "ops": ops,
    }
    if whole:
        step = whole["insns_per_call_raw"]
        out["whole_step_insns"] = step
        out["coverage"] = round(total / step, 4)
    return out
