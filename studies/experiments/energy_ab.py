"""Decode speed and tokens per CPU-second of several engine configurations, interleaved (the order reversed
every other round), each probe in its own process (bench/engine_probe.py, energy only: the known prompt's
128-token decode). For comparing two builds of one variant, e.g. two `fast` plans converted into two homes.

    python -m studies.experiments.energy_ab --rounds 6 --json OUT \\
        --simmer fast-whole=HOME1/models/M/V:fast --simmer fast-half=HOME2/models/M/V:fast --gguf G.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from bench.engine_bench import run_probe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simmer", action="append", default=[], help="LABEL=MODEL_DIR:VARIANT (repeatable)")
    ap.add_argument("--gguf", help="llama.cpp on this GGUF as the peer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfgs: dict[str, dict[str, Any]] = {}
    for spec in args.simmer:
        label, _, rest = spec.partition("=")
        model_dir, _, variant = rest.rpartition(":")
        cfgs[label] = {"engine": "simmer", "model_dir": model_dir, "variant": variant}
    if args.gguf:
        cfgs["llama.cpp"] = {"engine": "llama.cpp", "gguf": args.gguf}
    for cfg in cfgs.values():
        cfg |= {"threads": args.threads, "energy_only": True}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in cfgs}
    for r in range(args.rounds):
        for label in list(cfgs) if r % 2 == 0 else list(reversed(cfgs)):
            out = run_probe(cfgs[label])
            runs[label].append((out["decode_tok_s_short"], out["tok_per_cpu_s"]))
        print(r, {k: v[-1] for k, v in runs.items()}, flush=True)
    summary = {
        k: {
            "decode_median": statistics.median(x[0] for x in v),
            "tok_per_cpu_s_median": statistics.median(x[1] for x in v),
            "all": v,
        }
        for k, v in runs.items()
    }
    base = summary.get("llama.cpp")
    for v in summary.values():
        if base:
            v["decode_vs_llama_cpp"] = round(v["decode_median"] / base["decode_median"], 3)
            v["tok_per_cpu_s_vs_llama_cpp"] = round(
                v["tok_per_cpu_s_median"] / base["tok_per_cpu_s_median"], 3
            )
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
