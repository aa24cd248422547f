"""The guest of `simmer bench cpu-cost --by-op`: every cut graph of a plan (bench/cpu_cost/cut.py), one
process, markers between.

    python -m bench.cpu_cost.op_guest --plan DIR/plan.json --calls N [--whole-calls M]

For each entry: a session with the engine's options (one thread), inputs and outputs bound once (as the
engine binds its step's), one warm run, a marker, N runs, a marker, N more, a marker. The counter's
markers then give instructions per call, (third - second) / N, whatever a first run sets up left out.
The whole decode step (the plan's last entry, when there) runs `--whole-calls` times instead: it costs
30-odd kinds' worth per call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_cost.op_guest")
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--calls", type=int, required=True)
    ap.add_argument("--whole-calls", type=int, default=None)
    args = ap.parse_args(argv)

    import onnxruntime as ort

    from bench.cpu_cost.cut import WHOLE
    from bench.cpu_cost.guest import mark
    from models.runtime.session import session_options

    plan = json.loads(args.plan.read_text())
    for entry in plan["entries"]:
        base = args.plan.parent / entry["file"]
        sess = ort.InferenceSession(f"{base}.onnx", session_options(1), providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        with np.load(f"{base}.npz") as inputs:
            for name in inputs.files:
                binding.bind_ortvalue_input(
                    name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(inputs[name]))
                )
        for name, spec in entry["outputs"].items():  # preallocated, as the engine's step binds its own
            out = np.empty(spec["shape"], np.dtype(spec["dtype"]))
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(out))
        calls = args.whole_calls if entry["label"] == WHOLE and args.whole_calls else args.calls
        sess.run_with_iobinding(binding)
        mark()
        for _ in range(calls):
            sess.run_with_iobinding(binding)
        mark()
        for _ in range(calls):
            sess.run_with_iobinding(binding)
        mark()
        del binding, sess


if __name__ == "__main__":
    main()
