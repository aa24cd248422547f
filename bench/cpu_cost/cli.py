"""The arguments of `simmer bench cpu-cost` and its run (bench/cli.py registers it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.cpu_cost.count import CLASSES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu",
        choices=[*sorted(CLASSES), "native"],
        required=True,
        help="the CPU class qemu emulates (counted), or native: this machine's CPU, timed",
    )
    p.add_argument("--model", default=None, help="installed model id (default: SIMMER_MODEL)")
    p.add_argument(
        "--model-dir",
        action="append",
        default=None,
        help="a converted model folder instead of the store (repeat: a variant from the first with it)",
    )
    p.add_argument("--variants", default=None, help="comma-separated (default: all in the folders)")
    p.add_argument("--gguf", default=None, help="the source GGUF for llama.cpp (default: the manifest's)")
    p.add_argument("--no-peer", action="store_true", help="count simmer alone")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode", type=int, default=16, help="decode steps, even: per token = (2N - N) / N")
    p.add_argument(
        "--arm64-root", default=None, help="an unpacked arm64 root (default: unpack the cached one)"
    )
    p.add_argument("--reps", type=int, default=3, help="native: runs per program (medians)")
    p.add_argument(
        "--by-op",
        action="store_true",
        help="split one decode step by operator kind (one-node graphs cut from the variant's graph)",
    )
    p.add_argument("--past", type=int, default=32, help="--by-op: the decode step's past length")
    p.add_argument(
        "--calls", type=int, default=8, help="--by-op: runs per kind (N; per call over the last N)"
    )
    p.add_argument("--json", help="write the report here too")


def source_gguf(manifest: dict[str, Any]) -> Path | None:
    """The GGUF the model was converted from, where the manifest says it was read, if still there."""
    path = manifest.get("source", {}).get("gguf_path")
    return Path(path) if path and Path(path).exists() else None


def run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    import json

    from bench.cpu_cost.run import bench_cpu_cost

    if args.model_dir:
        dirs = [Path(d) for d in args.model_dir]
        gguf = Path(args.gguf) if args.gguf else None
    else:
        from models.store.store import ModelStore

        installed = ModelStore(settings.home).load(args.model or settings.model)
        dirs = [installed.path]
        gguf = Path(args.gguf) if args.gguf else source_gguf(installed.manifest)
    if args.variants:
        variants = args.variants.split(",")
    else:
        variants = sorted(
            {v for d in dirs for v in json.loads((d / "manifest.json").read_text())["variants"]}
        )
    if args.by_op:
        from bench.cpu_cost.by_op import bench_by_op

        if args.cpu == "native":
            raise SystemExit("--by-op counts: choose an emulated class (avx2, cortex-a76, cortex-a72)")
        return bench_by_op(
            args.cpu,
            dirs,
            variants,
            past=args.past,
            calls=args.calls,
            arm64_root=Path(args.arm64_root) if args.arm64_root else None,
        )
    return bench_cpu_cost(
        args.cpu,
        dirs,
        variants,
        None if args.no_peer else gguf,
        prompt_tokens=args.prompt_tokens,
        decode=args.decode,
        arm64_root=Path(args.arm64_root) if args.arm64_root else None,
        reps=args.reps,
    )
