"""Load-time peak memory of an untied vocabulary head: one MatMulNBits node (converter 8) against slices of
its rows (converter 9, models/convert/linear.py row_sliced).

    python -m studies.experiments.head_memory [--out DIR] [--rounds 3] [--threads 2]   (from the repo root)

Writes synthetic GGUFs into DIR (one tiny Q8_0 block, a Q8_0 table and an untied output.weight of a real
model's shape, by tests/tiny_gguf.py), converts each twice (`linear.SLICE_BYTES` out of reach: one node;
the default: slices), then opens each variant's decoder with the engine's own DecoderSession in a fresh
process per measurement, rounds interleaved so that drift on a shared machine hits every layout alike.
Per process: the peak RSS while the session is created (VmHWM after it, reset just before, less the RSS
before it), the RSS after it, and after one decode step. Prints one JSON line per process and a table of
medians. `--gguf PATH` measures a real GGUF too (its heads, tied or not, built both ways), `--only` skips
the synthetic ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SOURCES = {
    # name: (vocab, hidden, heads, output.weight type)
    "qwen2.5-0.5b-shape Q8_0 head (151,936 x 896)": (151936, 896, 14, "Q8_0"),
    "llama3-shape Q6_K head (128,256 x 1024)": (128256, 1024, 8, "Q6_K"),
    "llama3-shape Q4_K head (128,256 x 1024)": (128256, 1024, 8, "Q4_K"),
}
BUILDS = {"one node": 1 << 40, "sliced": None}  # linear.SLICE_BYTES (None: the converter's own)
VARIANTS = ("q4", "q4-a8")


def write_source(path: Path, vocab: int, hidden: int, heads: int, head_type: str) -> None:
    from tests.tiny_gguf import CONTROL, MERGES, TinySpec, tiny_vocab, write_tiny_gguf

    tokens = tiny_vocab()
    tokens += [f"<|reserved_{i}|>" for i in range(len(tokens), vocab)]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in CONTROL else 1 for t in tokens],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    spec = TinySpec(n_layers=1, hidden=hidden, ffn=256, n_heads=heads, n_kv_heads=2, tied=False)
    write_tiny_gguf(
        path,
        matrix_type="Q8_0",
        spec=spec,
        vocabulary=meta,
        tensor_types={"output.weight": head_type},
        name="head-memory",
    )


def prepare(out: Path, real: list[Path], synthetic: bool) -> list[tuple[str, str, str, Path]]:
    """(source, build, variant, decoder path) for every combination, converting what is not there yet."""
    from models.convert import linear
    from models.convert.pipeline import CONVERTER_VERSION, convert

    todo = []
    sources: list[tuple[str, Path]] = [(p.name, p) for p in real]
    if synthetic:
        for i, (name, (vocab, hidden, heads, head_type)) in enumerate(SOURCES.items()):
            gguf = out / f"head{i}-{head_type}-{vocab}x{hidden}.gguf"
            if not gguf.exists():
                print(f"writing {gguf}", file=sys.stderr, flush=True)
                write_source(gguf.with_suffix(".tmp"), vocab, hidden, heads, head_type)
                gguf.with_suffix(".tmp").rename(gguf)
            sources.append((name, gguf))
    for name, gguf in sources:
        for build, slice_bytes in BUILDS.items():
            folder = out / f"{gguf.stem}-v{CONVERTER_VERSION}-{build.replace(' ', '-')}"
            if not (folder / "manifest.json").exists():
                print(f"converting {folder}", file=sys.stderr, flush=True)
                folder.mkdir(exist_ok=True)
                for f in folder.iterdir():
                    f.unlink()
                default = linear.SLICE_BYTES
                linear.SLICE_BYTES = slice_bytes or default
                try:
                    frag = convert(gguf, folder, variants=list(VARIANTS), measure=False)
                finally:
                    linear.SLICE_BYTES = default
                (folder / "manifest.json").write_text(json.dumps(frag))
            todo += [(name, build, v, folder / f"{v}.onnx") for v in VARIANTS]
    return todo


def vm_hwm() -> int:
    """The process's peak RSS in bytes since it began or since clear_refs was last written 5 (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def probe(path: Path, threads: int) -> dict:
    """In a fresh process: memory around creating the session, and after one decode step."""
    import onnx
    import psutil

    from models.runtime.session import DecoderSession, KVCache, ModelShape

    arch = json.loads((path.parent / "manifest.json").read_text())["architecture"]
    shape = ModelShape.from_architecture(arch)
    heads = sum(
        n.op_type == "MatMulNBits" and n.input[1].startswith(("lm_head.", "token_embd."))
        for n in onnx.load(str(path), load_external_data=False).graph.node
    )
    proc = psutil.Process()
    # the peak from here on: ru_maxrss would not do, it carries the parent's peak across fork and exec
    Path("/proc/self/clear_refs").write_text("5")
    rss0 = proc.memory_info().rss
    sess = DecoderSession(path, shape, threads)
    peak = vm_hwm()
    rss_load = proc.memory_info().rss
    sess.run(np.array([5]), KVCache(sess.shape, 16), 0)
    rss_step = proc.memory_info().rss
    mb = 1 << 20
    return {
        "head_nodes": heads,
        "rss_before_mb": round(rss0 / mb, 1),
        "load_peak_mb": round((peak - rss0) / mb, 1),
        "after_load_mb": round((rss_load - rss0) / mb, 1),
        "after_step_mb": round((rss_step - rss0) / mb, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "simmer-head-memory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf", type=Path, action="append", default=[], help="a real GGUF to measure too")
    ap.add_argument("--only", action="store_true", help="only the --gguf files, no synthetic ones")
    ap.add_argument("--json", type=Path, help="write every measurement and the medians here")
    ap.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        print(json.dumps(probe(a.probe, a.threads)))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    todo = prepare(a.out, a.gguf, not a.only)
    results: dict[tuple[str, str, str], list[dict]] = {t[:3]: [] for t in todo}
    for r in range(a.rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)]
        if r % 2:  # and alternate which build of a pair goes first
            order = order[::-1]
        for name, build, variant, path in order:
            cmd = [
                sys.executable,
                "-m",
                "studies.experiments.head_memory",
                "--probe",
                str(path),
                "--threads",
                str(a.threads),
            ]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            results[(name, build, variant)].append(res)
            print(
                json.dumps({"source": name, "build": build, "variant": variant, "round": r, **res}),
                flush=True,
            )
    keys = ("load_peak_mb", "after_load_mb", "after_step_mb")
    medians = []
    for (name, build, variant), rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in keys}
        medians.append(
            {"source": name, "build": build, "variant": variant, "head_nodes": rs[0]["head_nodes"], **med}
        )
    if a.json:
        runs = [{"source": k[0], "build": k[1], "variant": k[2], "runs": rs} for k, rs in results.items()]
        doc = {"threads": a.threads, "rounds": a.rounds, "medians": medians, "all": runs}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nmedians of {a.rounds} processes, {a.threads} threads, MB over the RSS before the session")
    print("| head | variant | build | head nodes | peak at load | after load | after a step |")
    print("|---|---|---|---|---|---|---|")
    for m in medians:
        print(
            f"| {m['source']} | {m['variant']} | {m['build']} | {m['head_nodes']} | "
            f"{m['load_peak_mb']:.0f} | {m['after_load_mb']:.0f} | {m['after_step_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
