"""`simmer bench cpu-cost --by-op`: a decode step's instructions split by operator, per CPU class.

For each variant: its decode graph cut into one-node graphs, one per kind of node (bench/cpu_cost/cut.py,
natively), then one guest process under the class's qemu (bench/cpu_cost/op_guest.py) runs every kind
2N+1 times and the whole step 2M+1 times, markers between. Per kind: instructions per call (net of an
empty run's), calls per decode step, their product's share of the whole step; and the coverage: the
kinds' sum over the whole step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.cpu_cost.count import CLASSES, CpuClass, run_counted
from bench.cpu_cost.cut import WHOLE, by_op, per_call, write_plan
from bench.cpu_cost.run import (
    NOT_SHOWN,
    REPO,
    arm64_guest,
    build,
    find_variant,
    manifest_variant,
    unpacked_arm64_root,
)

METHOD = (
    "The variant's graph as onnxruntime optimizes it (the engine's session options, one thread) runs one "
    "decode step natively (one token after `past` positions, random past keys and values), keeping every "
    "value. Nodes of one operator, attributes, weight role and input shapes are a kind; the first of each "
    "becomes a one-node graph with its own initializers, fed the values it saw. One guest process under "
    "qemu runs each kind once, then N times, then N more (markers between; inputs and outputs bound once); "
    "per call = the last N's count / N, minus an Identity graph's (a run's own cost). The whole optimized "
    "graph runs the same way (whole_calls). share_of_step: calls per token x per call over the whole step."
)


def guest_command(
    cpu: CpuClass, plan: Path, calls: int, whole_calls: int, root: Path | None
) -> tuple[list[str], dict[str, str]]:
    if cpu.emulated_arm:
        if root is None:
            raise ValueError("an arm64 class needs the arm64 root filesystem (--arm64-root)")
        python, env = arm64_guest(root, cpu)
    else:
        python, env = [sys.executable], {"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [*python, "-m", "bench.cpu_cost.op_guest", "--plan", str(plan), "--calls", str(calls)]
    return [*cmd, "--whole-calls", str(whole_calls)], env


def count_plan(
    cpu: CpuClass, plugin: Path, plan: Path, calls: int, whole_calls: int, root: Path | None
) -> dict[str, Any]:
    entries = json.loads(plan.read_text())["entries"]
    cmd, env = guest_command(cpu, plan, calls, whole_calls, root)
    counted = run_counted(cpu, plugin, cmd, env=env, prefix=root)
    marks = [m - counted.marks[0] for m in counted.marks]  # only differences are used; start-up kept aside
    per_entry_calls = [whole_calls if e["label"] == WHOLE else calls for e in entries]
    return {
        "startup_insns": counted.marks[0],
        "guest_threads": counted.vcpus,
        **by_op(per_call(marks, per_entry_calls, entries)),
    }


def bench_by_op(
    cpu_name: str,
    model_dirs: list[Path],
    variants: list[str],
    *,
    past: int = 32,
    calls: int = 8,
    whole_calls: int = 2,
    arm64_root: Path | None = None,
) -> dict[str, Any]:
    cpu = CLASSES[cpu_name]
    plugin = build("plugin")
    results = []
    with tempfile.TemporaryDirectory(prefix="cpu-cost-by-op-", dir="/var/tmp") as tmp:
        root = None  # qemu's -L: an x86 guest runs the host's own files
        if cpu.emulated_arm:
            root = arm64_root or unpacked_arm64_root(Path(tmp))
        for variant in variants:
            model_dir = find_variant(model_dirs, variant)
            entry = manifest_variant(model_dir, variant)
            plan = write_plan(model_dir / entry["file"], Path(tmp) / variant, past=past)
            print(f"counting simmer {variant} by operator on {cpu.name}", file=sys.stderr)
            counted = count_plan(cpu, plugin, plan, calls, whole_calls, root)
            results.append(
                {
                    "engine": "simmer",
                    "variant": variant,
                    "plan": entry.get("plan"),
                    "how": "counted",
                    **counted,
                }
            )
    return {
        "cpu_class": cpu.name,
        "qemu": f"{cpu.qemu} -cpu {cpu.qemu_cpu} (TCG) + bench/cpu_cost/insn_count.c",
        "model": str(model_dirs[0]),
        "threads": 1,
        "past": past,
        "calls": calls,
        "whole_calls": whole_calls,
        "method": METHOD,
        "what_a_count_cannot_show": NOT_SHOWN,
        "results": results,
    }
