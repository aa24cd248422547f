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

from bench.cpu_cost.count import CLASSES, Counted, CpuClass, phases, run_counted
from bench.cpu_cost.timed import timed_rounds
from bench.cpu_cost.weights import gguf_decode_bytes, onnx_decode_bytes

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NOT_SHOWN = (
    "Instructions retired, counted under qemu's TCG: work, not time. A count cannot show caches or memory "
    "stalls (a decode step reads every weight: bandwidth-bound on a small core), how many instructions a "
    "core retires per cycle (SIMD width, vector pipes and latencies differ between cores running the same "
    "instruction; an instruction of one ISA is not one of another), nor clocks, throttling or the "
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
    # a new file, not the old one rewritten: a root copied with hard links (cp -al) keeps its own
    (root / "proc" / "cpuinfo.new").write_text(cpuinfo)
    (root / "proc" / "cpuinfo.new").replace(root / "proc" / "cpuinfo")
    site = next((root / "src" / ".venv" / "lib").glob("python3*/site-packages"))
    return [str(root / "usr" / "bin" / "python3")], {
        "PYTHONPATH": f"{REPO}:{site}",
        "PYTHONDONTWRITEBYTECODE": "1",  # the checkout is the host's: leave its __pycache__ alone
    }


def simmer_command(
    cpu: CpuClass | None, model_dir: Path, variant: str, ids: list[int], decode: int, root: Path | None
) -> tuple[list[str], dict[str, str]]:
    """simmer's guest: the host's Python (x86 classes, and natively: cpu None) or the arm64 root's."""
    if cpu is not None and cpu.emulated_arm:
        if root is None:
            raise ValueError("an arm64 class needs the arm64 root filesystem (--arm64-root)")
        python, env = arm64_guest(root, cpu)
    else:
        python, env = [sys.executable], {"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [*python, "-m", "bench.cpu_cost.guest", "--model-dir", str(model_dir), "--variant", variant]
    return [*cmd, "--ids", ",".join(map(str, ids)), "--decode", str(decode)], env


def llama_command(build_class: str, gguf: Path, ids: list[int], decode: int) -> list[str]:
    return [str(build("llama", build_class)), str(gguf), str(decode), ",".join(map(str, ids))]


def simmer_facts(model_dir: Path, variant: str) -> dict[str, Any]:
    entry = manifest_variant(model_dir, variant)
    return {
        "engine": "simmer",
        "variant": variant,
        "plan": entry.get("plan"),
        **onnx_decode_bytes(model_dir / entry["file"]),
    }


def llama_facts(build_class: str, gguf: Path) -> dict[str, Any]:
    return {
        "engine": "llama.cpp",
        "variant": "gguf",
        "build": f"llama-cpp-python 0.3.36's vendor/llama.cpp, {build_class} (bench/cpu_cost/build.sh)",
        **gguf_decode_bytes(gguf),
    }


def count_simmer(
    cpu: CpuClass, plugin: Path, model_dir: Path, variant: str, ids: list[int], decode: int, root: Path | None
) -> dict[str, Any]:
    cmd, env = simmer_command(cpu, model_dir, variant, ids, decode, root)
    counted = run_counted(cpu, plugin, cmd, env=env, prefix=root)
    return {**simmer_facts(model_dir, variant), **counted_result(counted, len(ids), decode)}


def count_llama(
    cpu: CpuClass, plugin: Path, gguf: Path, ids: list[int], decode: int, root: Path | None
) -> dict[str, Any]:
    counted = run_counted(cpu, plugin, llama_command(cpu.name, gguf, ids, decode), prefix=root)
    return {**llama_facts(cpu.name, gguf), **counted_result(counted, len(ids), decode)}


def counted_result(counted: Counted, prompt_tokens: int, decode: int) -> dict[str, Any]:
    return {
        "how": "counted",
        **phases(counted.marks, prompt_tokens, decode),
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
    reps: int = 3,
) -> dict[str, Any]:
    arch = json.loads((model_dirs[0] / "manifest.json").read_text())["architecture"]
    ids = prompt_ids(prompt_tokens, int(arch["vocab"]))
    if cpu_name == "native":
        return bench_native(model_dirs, variants, gguf, ids, decode, reps)
    cpu = CLASSES[cpu_name]
    plugin = build("plugin")
    with tempfile.TemporaryDirectory(prefix="cpu-cost-root-", dir="/var/tmp") as tmp:
        root = arm64_root
        if cpu.emulated_arm and root is None:
            root = unpacked_arm64_root(Path(tmp))
        results = []
        if gguf is not None:  # first: a minute, where each of simmer's takes several (Python, onnxruntime)
            print(f"counting llama.cpp on {cpu.name}", file=sys.stderr)
            results.append(count_llama(cpu, plugin, gguf, ids, decode, root))
        for variant in variants:
            print(f"counting simmer {variant} on {cpu.name}", file=sys.stderr)
            results.append(
                count_simmer(cpu, plugin, find_variant(model_dirs, variant), variant, ids, decode, root)
            )
    relative_to_peer(results, ("insns_per_decoded_token", "insns_per_prompt_token"))
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


def relative_to_peer(results: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    """Each result's keys over llama.cpp's (the peer's, when it ran)."""
    peer = next((r for r in results if r["engine"] == "llama.cpp"), None)
    if peer:
        for r in results:
            for key in keys:
                r[f"{key}_vs_llama_cpp"] = round(r[key] / peer[key], 3)


def bench_native(
    model_dirs: list[Path], variants: list[str], gguf: Path | None, ids: list[int], decode: int, reps: int
) -> dict[str, Any]:
    """This machine's own CPU, timed: simmer's variants (onnxruntime dispatches to this CPU's kernels) and
    llama.cpp built for it (GGML_NATIVE=ON), plus llama.cpp's AVX2 and SSE 4.2 builds (on an x86 machine),
    the binaries counted under -cpu Haswell, for the calibration in docs/cpu-classes.md."""
    import platform

    facts: list[dict[str, Any]] = []
    programs: list[tuple[list[str], dict[str, str] | None]] = []
    for variant in variants:
        model_dir = find_variant(model_dirs, variant)
        facts.append(simmer_facts(model_dir, variant))
        programs.append(simmer_command(None, model_dir, variant, ids, decode, None))
    if gguf is not None:
        # avx2 and sse42: one program each, counted under -cpu Haswell and timed here (the calibration)
        builds = ["native", "avx2", "sse42"] if platform.machine() == "x86_64" else ["native"]
        for build_class in builds:
            facts.append(llama_facts(build_class, gguf))
            programs.append((llama_command(build_class, gguf, ids, decode), None))
    print(f"timing {len(programs)} programs natively, {reps} rounds", file=sys.stderr)
    results = [{**f, **t} for f, t in zip(facts, timed_rounds(programs, len(ids), decode, reps), strict=True)]
    relative_to_peer(results, ("ms_per_decoded_token", "ms_per_prompt_token"))
    return {
        "cpu_class": "native",
        "cpu": cpu_model(),
        "model": str(model_dirs[0]),
        "gguf": str(gguf) if gguf else None,
        "threads": 1,
        "prompt_tokens": len(ids),
        "prompt_ids": ids,
        "decode_steps": decode,
        "method": (
            "the counted guests run natively, each in its own process, `reps` rounds, interleaved; time "
            "read at the same markers; medians. Per decoded token: (time after 2N steps - after N) / N. "
            "The *_vs_llama_cpp ratios are over the first llama.cpp build listed (native)."
        ),
        "results": results,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
