"""What an fp16 KV cache costs in quality: KL from the fp32 reference of the same variant with an fp32 and an
fp16 cache, beside llama.cpp (whose CPU cache is fp16 by default) and the int8 reference, on the CPU this
runs on, as studies/experiments/quality.py measures (teacher-forced, one token per pass, 256 positions).

    python -m studies.experiments.kv_fp16 --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --folder q4-a8/fp32=DIR_A:q4-a8 --folder q4-a8/fp16=DIR_B:q4-a8 [--json OUT]

Each folder is a converted model (`convert(..., kv_dtype=...)`); the label names the row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from studies.experiments.quality import (
    TEXT,
    llama_cpp_step,
    machine,
    summarize,
    teacher_forced,
    variant_step,
)


def measure(gguf: Path, folders: list[tuple[str, Path, str]], threads: int, peer: bool) -> dict[str, Any]:
    from models.convert.model import GGUFModel
    from models.convert.reference import ReferenceForward
    from models.runtime.tokenizer import Tokenizer

    ids = Tokenizer.load(folders[0][1]).encode(TEXT, add_special_tokens=False)[:256]
    forward = ReferenceForward(GGUFModel(gguf))
    ref = forward.logits(ids)
    forward.int8_activations = True
    int8 = forward.logits(ids)
    del forward
    report: dict[str, Any] = {
        "method": "quality.py's: KL(fp32 reference || engine) per position, teacher-forced",
        "gguf": gguf.name,
        "positions": len(ids),
        "threads": threads,
        **machine(),
        "int8_reference": summarize(ref, int8),
        "rows": {},
    }
    for label, folder, variant in folders:
        t0 = time.perf_counter()
        manifest = json.loads((folder / "manifest.json").read_text())
        kv = manifest["variants"][variant].get("kv_dtype") or manifest.get("kv_dtype") or "float32"
        logits = teacher_forced(variant_step(folder, variant, threads), ids)
        report["rows"][label] = (
            summarize(ref, logits)
            | {"variant": variant, "kv_dtype": kv}
            | {"seconds": round(time.perf_counter() - t0, 1)}
        )
    step = llama_cpp_step(gguf, threads) if peer else None
    if step is not None:
        report["llama.cpp"] = summarize(ref, teacher_forced(step, ids))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.experiments.kv_fp16", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument("--folder", action="append", required=True, help="LABEL=DIR:VARIANT (repeat)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    folders = []
    for spec in args.folder:
        label, rest = spec.split("=", 1)
        folder, variant = rest.rsplit(":", 1)
        folders.append((label, Path(folder), variant))
    text = json.dumps(measure(args.gguf, folders, args.threads, not args.no_peer), indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
