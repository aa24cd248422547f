"""What the exact min term of Q4_1 / Q4_K tensors costs a decode step, against llama.cpp in the same run.

    python -m studies.experiments.min_correction MODEL_DIR GGUF [--variant q4-a8] [--rounds 3]
        [--prompt-tokens 16] [--out F.json]

GGUF formats with a min store w = d * q + m per 32-block. MatMulNBits has no exact place for m: its zero
points are integers (W = scale * (u - zp)), and a float zero point takes onnxruntime's unpacked path,
which dequantizes the whole matrix on every call. So the converter adds y += blocksum(x) @ corr^T per
linear (models/convert/linear.py): a block-sum MatMul and a correction Gemm, two small fp32 nodes that run
on one thread, 240 of them in SmolLM2 135M.

This bench measures that cost on the real graph. It writes a copy of the variant's graph without those
nodes (the MatMulNBits output goes straight on, so its text is wrong: timing only, never served) beside
the model folder, with the weights file hard-linked (copied across file systems), and runs
studies.experiments.decode_steps on the original, the copy and llama.cpp on the same GGUF, interleaved, each
probe in its own process. The difference between the first two is what the min term costs; the copy against
llama.cpp is how the rest of the engine compares.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.engine_probe import PROMPT_TOKENS
from studies.experiments import decode_steps

INDICATOR = "block_indicator"


def without_min_term(graph: Any) -> int:
    """Drop every block-sum MatMul and correction Gemm from an onnx GraphProto in place, rewiring each
    Gemm's consumers to its third input (the MatMulNBits output). Returns how many nodes went."""
    alias: dict[str, str] = {}
    sums: set[str] = set()
    gemm_inputs = {n.input[0] for n in graph.node if n.op_type == "Gemm"}
    kept = []
    for node in graph.node:
        # the block sums: a MatMul with a 0/1 indicator (converter 12 and before), else a ReduceSum that
        # feeds a correction Gemm (its Reshape is left, unused)
        if (node.op_type == "MatMul" and node.input[1].startswith(INDICATOR)) or (
            node.op_type == "ReduceSum" and node.output[0] in gemm_inputs
        ):
            sums.add(node.output[0])
            continue
        if node.op_type == "Gemm" and node.input[0] in sums:
            alias[node.output[0]] = node.input[2]
            continue
        kept.append(node)
    for node in kept:
        for i, name in enumerate(node.input):
            while name in alias:
                name = alias[name]
            node.input[i] = name
    dropped = len(graph.node) - len(kept)
    del graph.node[:]
    graph.node.extend(kept)
    return dropped


def stripped_copy(model_dir: Path, variant: str, dest: Path) -> int:
    """The model folder at `dest` with `variant`'s graph stripped of the min term (see without_min_term).
    onnxruntime refuses external data outside the graph's folder, so the weights are linked, not
    symlinked."""
    import onnx

    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name == f"{variant}.onnx" or not f.is_file():
            continue
        try:
            os.link(f, dest / f.name)
        except OSError:
            shutil.copy2(f, dest / f.name)
    model = onnx.load(str(model_dir / f"{variant}.onnx"), load_external_data=False)
    dropped = without_min_term(model.graph)
    onnx.save(model, str(dest / f"{variant}.onnx"))
    return dropped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--variant", default="q4-a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--prompt-tokens", type=int, default=16, help=f"context before decoding ({PROMPT_TOKENS}: long)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    model_dir = args.model_dir.resolve()
    work = Path(tempfile.mkdtemp(prefix=".min-correction-", dir=model_dir.parent))
    try:
        stripped = work / "stripped"
        dropped = stripped_copy(model_dir, args.variant, stripped)
        out = work / "decode_steps.json"
        decode_steps.main(
            [
                str(model_dir),
                str(args.gguf),
                "--variant",
                args.variant,
                "--variants",
                f"{model_dir}=simmer,{stripped}=simmer-without-min-term",
                "--threads",
                str(args.threads),
                "--rounds",
                str(args.rounds),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--no-profile",
                "--out",
                str(out),
            ]
        )
        report = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = report["summary"]
    step = {label: s[label]["step_ms"] for label in s}
    report["bench"] = "min_correction"
    report["nodes_dropped"] = dropped
    report["prompt_tokens"] = args.prompt_tokens
    report["min_term_ms"] = round(step["simmer"] - step["simmer-without-min-term"], 3)
    report["ratios_to_llama_cpp"] = {
        label: round(step["llama.cpp"] / step[label], 3) for label in step if label != "llama.cpp"
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    brief = {k: report[k] for k in ("nodes_dropped", "min_term_ms", "ratios_to_llama_cpp")}
    print(json.dumps(brief), file=sys.stderr)


if __name__ == "__main__":
    main()
