"""What would a SmolLM2-sized head (49152 x 576) cost per call by other routes, counted per CPU class?

On a Cortex-A72 (no dot product) the 8-bit MatMulNBits head of `q4-a8` and `fast` is 60 % of a decode
step (docs/cpu-classes.md, per operator): MLAS has no int8 kernel there and no fp32 one for 8 bits, so
onnxruntime dequantizes the whole matrix on every call. The candidates, one-node graphs with random
weights of the head's shape (values do not change which instructions run), counted as `cpu-cost --by-op`
counts its kinds (bench/cpu_cost/by_op.py's count_plan):

- `MatMulNBits 8-bit, accuracy_level 4`: the head as it is;
- `MatMulNBits 4-bit, accuracy_level 1`: the head at 4 bits (MLAS's fp32 kernel, as `q4`'s head);
- `MatMulNBits 4-bit, accuracy_level 4`: the same, int8 where the class has it;
- `DynamicQuantizeMatMul`: 8-bit weights with one scale per column (a re-quantization of Q8_0's blocks),
  activations quantized per call: MLAS's integer GEMM, which has a kernel without the dot product;
- `MatMul fp32`: the head dequantized at load (4 bytes a weight: 113 MB read per token).

    python -m studies.experiments.head_routes --cpu cortex-a72 [--arm64-root ROOT] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

N, K, BLOCK = 49152, 576, 32


def graphs() -> list[tuple[str, Any, dict[str, np.ndarray]]]:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, K)).astype(np.float32)
    blocks = K // BLOCK
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])
    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]

    def model(node: Any, inits: dict[str, np.ndarray]) -> Any:
        graph = helper.make_graph(
            [node], "head", [inp], [out], [numpy_helper.from_array(v, k) for k, v in inits.items()]
        )
        return helper.make_model(graph, opset_imports=opsets)

    def nbits(bits: int, level: int) -> Any:
        per_block = BLOCK * bits // 8
        q = rng.integers(0, 256, (N, blocks, per_block), dtype=np.uint8)
        scales = (rng.random((N, blocks), dtype=np.float32) * 0.01).astype(np.float32)
        attrs: dict[str, Any] = {"K": K, "N": N, "bits": bits, "block_size": BLOCK, "accuracy_level": level}
        node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", **attrs)
        return model(node, {"q": q, "s": scales})

    w8 = rng.integers(-127, 128, (K, N), dtype=np.int8)
    dq = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "ws"], ["y"], domain="com.microsoft")
    dq_model = model(dq, {"w": w8, "ws": (rng.random(N, dtype=np.float32) * 0.01).astype(np.float32)})
    fp32 = model(
        helper.make_node("MatMul", ["x", "w"], ["y"]), {"w": rng.standard_normal((K, N)).astype(np.float32)}
    )
    return [
        ("MatMulNBits 8-bit, accuracy_level 4", nbits(8, 4), {"x": x}),
        ("MatMulNBits 4-bit, accuracy_level 1", nbits(4, 1), {"x": x}),
        ("MatMulNBits 4-bit, accuracy_level 4", nbits(4, 4), {"x": x}),
        ("DynamicQuantizeMatMul int8, a scale per column", dq_model, {"x": x}),
        ("MatMul fp32", fp32, {"x": x}),
    ]


def write(into: Path) -> Path:
    import onnx

    from bench.cpu_cost.cut import OVERHEAD, overhead_graph, save_arrays

    entries = []
    for i, (label, graph, feed) in enumerate([(OVERHEAD, *overhead_graph()), *graphs()]):
        file = f"{i:02d}-head"
        onnx.save(graph, str(into / f"{file}.onnx"))
        save_arrays(into / f"{file}.npz", feed)
        shape = [1] if label == OVERHEAD else [1, N]
        outputs = {"y": {"shape": shape, "dtype": "float32"}}
        entries.append(
            {
                "label": label,
                "key": label,
                "calls_per_token": 0 if label == OVERHEAD else 1,
                "file": file,
                "outputs": outputs,
            }
        )
    plan = into / "plan.json"
    plan.write_text(
        json.dumps({"source": "studies/experiments/head_routes.py", "entries": entries}, indent=1)
    )
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.experiments.head_routes")
    ap.add_argument("--cpu", required=True)
    ap.add_argument("--arm64-root", type=Path, default=None)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from bench.cpu_cost.by_op import count_plan
    from bench.cpu_cost.count import CLASSES
    from bench.cpu_cost.run import build

    with tempfile.TemporaryDirectory(prefix="head-routes-", dir="/var/tmp") as tmp:
        plan = write(Path(tmp))
        counted = count_plan(
            CLASSES[args.cpu], build("plugin"), plan, args.calls, args.calls, args.arm64_root
        )
    report = {
        "cpu_class": args.cpu,
        "how": "counted",
        "head": {"rows": N, "k": K, "block": BLOCK},
        "calls": args.calls,
        "routes": [{"route": o["op"], "insns_per_call": o["insns_per_call"]} for o in counted["ops"]],
        "run_overhead_insns": counted["run_overhead_insns"],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
