"""`simmer bench cpu-cost --cpu avx2|cortex-a76|cortex-a72`: simmer's variants and llama.cpp, counted.

For one CPU class: each of simmer's variants (python -m bench.cpu_cost.guest) and llama.cpp built for that
class (llama_count.cpp, build.sh) run under the class's qemu with the counter plugin, one thread, the same
GGUF (simmer's folders are converted from it), the same prompt ids and the same number of greedy decode
steps. Each result: guest instructions per prompt token and per decoded token, and the weight bytes a
decode step reads. The arm64 guests run the arm64 root filesystem's Python (tests/arm64/rootfs.sh) with
qemu's -L pointed at it, this checkout's code on the PYTHONPATH.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.cpu_cost.count import CLASSES, CpuClass, phases, run_counted
from bench.cpu_cost.weights import gguf_decode_bytes, onnx_decode_bytes

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NOT_SHOWN = (
    "Instructions retired, counted under qemu's TCG: work, not time. A count cannot show caches or memory "
    "stalls (a decode step reads every weight: bandwidth-bound on a small core), how many instructions a "
    "core retires per cycle (SIMD width and ports: a Cortex-A76 issues two 128-bit NEON ops a cycle, an A72 "
    "two narrower pipes; an instruction of one ISA is not one of another), nor clocks, throttling or the "
    "other threads' share of the core. Ranks the code paths of one CPU class; compare ratios within a "
    "class, not counts across classes."
)


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Ordinary token ids (above the control tokens), the same list for every guest."""
    rng = np.random.default_rng(seed)
    lo = min(300, vocab // 4)
    return [int(x) for x in rng.integers(lo, min(40000, vocab), n)]


def build(*args: str) -> Path:
    proc = subprocess.run(["bash", str(HERE / "build.sh"), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"build.sh {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def arm64_guest(root: Path, cpu: CpuClass) -> tuple[list[str], dict[str, str]]:
    """The root's Python and environment: libraries and the loader come through -L, /proc/cpuinfo too (a
    regular file at ROOT/proc/cpuinfo: onnxruntime's cpuinfo faults on the host's x86 one)."""
    cpuinfo = subprocess.run(
        ["bash", str(REPO / "tests" / "arm64" / "cpuinfo.sh"), cpu.name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "cpuinfo").write_text(cpuinfo)
    site = next((root / "src" / ".venv" / "lib").glob("python3*/site-packages"))
    return [str(root / "usr" / "bin" / "python3")], {
        "PYTHONPATH": f"{REPO}:{site}",
        "PYTHONDONTWRITEBYTECODE": "1",  # the checkout is the host's: leave its __pycache__ alone
    }


def count_simmer(
    cpu: CpuClass, plugin: Path, model_dir: Path, variant: str, ids: list[int], decode: int, root: Path | None
) -> dict[str, Any]:
    if cpu.emulated_arm:
        if root is None:
            raise ValueError("an arm64 class needs the arm64 root filesystem (--arm64-root)")
        python, env = arm64_guest(root, cpu)
    else:
        python, env = [sys.executable], {"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [*python, "-m", "bench.cpu_cost.guest", "--model-dir", str(model_dir), "--variant", variant]
    counted = run_counted(
        cpu, plugin, [*cmd, "--ids", ",".join(map(str, ids)), "--decode", str(decode)], env=env, prefix=root
    )
    entry = manifest_variant(model_dir, variant)
    return {
        "engine": "simmer",
        "variant": variant,
        "plan": entry.get("plan"),
        "how": "counted",
        **phases(counted.marks, len(ids), decode),
        **onnx_decode_bytes(model_dir / entry["file"]),
        "guest_threads": counted.vcpus,
        "tokens": counted.stdout,
    }


def count_llama(
    cpu: CpuClass, plugin: Path, gguf: Path, ids: list[int], decode: int, root: Path | None
) -> dict[str, Any]:
    binary = build("llama", cpu.name)
    counted = run_counted(
        cpu, plugin, [str(binary), str(gguf), str(decode), ",".join(map(str, ids))], prefix=root
    )
    return {
        "engine": "llama.cpp",
        "variant": "gguf",
        "build": f"llama-cpp-python 0.3.36 vendor/llama.cpp, {cpu.name} (bench/cpu_cost/build.sh)",
        "how": "counted",
        **phases(counted.marks, len(ids), decode),
        **gguf_decode_bytes(gguf),
        "guest_threads": counted.vcpus,
        "tokens": counted.stdout,
    }


def manifest_variant(model_dir: Path, variant: str) -> dict[str, Any]:
    return json.loads((model_dir / "manifest.json").read_text())["variants"][variant]


def find_variant(model_dirs: list[Path], variant: str) -> Path:
    for d in model_dirs:
        if variant in json.loads((d / "manifest.json").read_text()).get("variants", {}):
            return d
    raise ValueError(f"no folder of {', '.join(map(str, model_dirs))} has the variant {variant!r}")


def unpacked_arm64_root(into: Path) -> Path:
    """The cached arm64 root filesystem (tests/arm64/rootfs.sh builds it the first time, ~30 min)."""
    tarball = (
        subprocess.run(
            ["bash", str(REPO / "tests" / "arm64" / "rootfs.sh")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    root = into / "root"
    root.mkdir()
    subprocess.run(f"zstd -q -d -c {tarball} | tar -C {root} --numeric-owner -xf -", shell=True, check=True)
    return root


def bench_cpu_cost(
    cpu_name: str,
    model_dirs: list[Path],
    variants: list[str],
    gguf: Path | None,
    *,
    prompt_tokens: int = 32,
    decode: int = 16,
    arm64_root: Path | None = None,
) -> dict[str, Any]:
    cpu = CLASSES[cpu_name]
    plugin = build("plugin")
    arch = json.loads((model_dirs[0] / "manifest.json").read_text())["architecture"]
    ids = prompt_ids(prompt_tokens, int(arch["vocab"]))
    with tempfile.TemporaryDirectory(prefix="cpu-cost-root-", dir="/var/tmp") as tmp:
        root = arm64_root
        if cpu.emulated_arm and root is None:
            root = unpacked_arm64_root(Path(tmp))
        results = []
        for variant in variants:
            print(f"counting simmer {variant} on {cpu.name}", file=sys.stderr)
            results.append(
                count_simmer(cpu, plugin, find_variant(model_dirs, variant), variant, ids, decode, root)
            )
        if gguf is not None:
            print(f"counting llama.cpp on {cpu.name}", file=sys.stderr)
            results.append(count_llama(cpu, plugin, gguf, ids, decode, root))
    peer = next((r for r in results if r["engine"] == "llama.cpp"), None)
    if peer:
        for r in results:
            for key in ("insns_per_decoded_token", "insns_per_prompt_token"):
                r[f"{key}_vs_llama_cpp"] = round(r[key] / peer[key], 3)
    return {
        "cpu_class": cpu.name,
        "qemu": f"{cpu.qemu} -cpu {cpu.qemu_cpu} (TCG) + bench/cpu_cost/insn_count.c",
        "model": str(model_dirs[0]),
        "gguf": str(gguf) if gguf else None,
        "threads": 1,
        "prompt_tokens": prompt_tokens,
        "prompt_ids": ids,
        "decode_steps": decode,
        "method": (
            "one process per engine: load, a prefill of the prompt ids, then greedy decode steps of one "
            "token; markers (close of a sentinel fd) split the count. Per prompt token: the prefill's count "
            "over the prompt's length. Per decoded token: (count after 2N steps - after N) / N, "
            "N = decode_steps / 2. Weight bytes per decoded token: every weight once, a lookup table one "
            "row, from the files."
        ),
        "what_a_count_cannot_show": NOT_SHOWN,
        "results": results,
    }
