"""How far each variant's next-token distributions are from the fp32 reference of the same GGUF, on the CPU
this runs on: KL divergence and top-1 agreement, teacher-forced over one fixed text, one token per forward
pass (the decode path), as `llama-perplexity --kl-divergence` measures it. llama.cpp is measured the same way
on the same token ids when llama-cpp-python is installed.

    python -m studies.experiments.quality --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--model-dir DIR] \
        [--json OUT]

onnxruntime picks its int8 kernels by the CPU's extensions (x86: AVX2 / AVX-512 VNNI; ARM: plain NEON, the
dot product, i8mm), so `q4-a8`'s numbers are a property of the machine as much as of the model: the report
records which CPU it ran on (under qemu-user, QEMU_CPU names the emulated core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.convert.quality import kl_rows

QUALITY_POSITIONS = 256

# Prose, code, numbers, facts and a chat turn: no single kind of token decides the mean.
TEXT = """\
The old harbour town wakes before the sun. Fishing boats slip out past the breakwater while the bakery on \
the corner pulls its first loaves from the oven, and by seven the market square smells of coffee, salt and \
bread. Visitors come for the cliffs, but most of them stay for the quiet.

def moving_average(values: list[float], window: int) -> list[float]:
    if window <= 0:
        raise ValueError("window must be positive")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

The Pacific Ocean covers about 165 million square kilometres, more than all of Earth's land put together. \
Its deepest point, the Challenger Deep, lies nearly 11,000 metres below the surface. In 1960 two men reached \
it in the bathyscaphe Trieste; the descent took almost five hours.

<|im_start|>user
What is the difference between a list and a tuple in Python?<|im_end|>
<|im_start|>assistant
A list is mutable: you can add, remove or change its items after creating it. A tuple is immutable, so \
it cannot change once made, which makes it usable as a dictionary key.<|im_end|>
"""


def _sig(x: float) -> float:
    return float(f"{float(x):.4g}")


def summarize(ref_logits: np.ndarray, logits: np.ndarray) -> dict[str, float | int]:
    kl = kl_rows(ref_logits, logits)
    return {
        "kl_mean": _sig(kl.mean()),
        "kl_p99": _sig(np.quantile(kl, 0.99)),
        "kl_max": _sig(kl.max()),
        "top1_agreement": round(float((ref_logits.argmax(-1) == logits.argmax(-1)).mean()), 4),
        "max_logit_error": round(float(np.abs(ref_logits - logits).max()), 4),
        "positions": len(kl),
    }


def teacher_forced(step: Callable[[int, int], np.ndarray], ids: Sequence[int]) -> np.ndarray:
    """Each position's logits, feeding the text's own tokens one at a time."""
    return np.stack([np.array(step(token, pos), np.float32) for pos, token in enumerate(ids)])


def variant_step(model_dir: Path, variant: str, threads: int) -> Callable[[int, int], np.ndarray]:
    from models.runtime.session import DecoderSession, KVCache, ModelShape

    manifest = json.loads((model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    sess = DecoderSession(model_dir / manifest["variants"][variant]["file"], shape, threads)
    kv = KVCache(sess.shape, QUALITY_POSITIONS + 8)  # the session's: its KV type is the graph's
    return lambda token, pos: sess.run(np.array([token]), kv, pos).copy()


def llama_cpp_step(gguf: Path, threads: int) -> Callable[[int, int], np.ndarray] | None:
    """llama.cpp on the same GGUF, one token per eval (None when llama-cpp-python is not installed)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(gguf), n_ctx=QUALITY_POSITIONS + 8, n_threads=threads, logits_all=True, verbose=False)

    def step(token: int, pos: int) -> np.ndarray:
        if pos == 0:
            llm.reset()
        llm.eval([token])
        return np.array(llm.scores[llm.n_tokens - 1], np.float32)

    return step


def machine() -> dict[str, Any]:
    import onnxruntime

    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("CPU part", "Features", "model name", "flags") and key not in cpu:
                cpu[key] = value.strip()[:200]
    except OSError:
        pass
    return {
        "machine": platform.machine(),
        "qemu_cpu": os.environ.get("QEMU_CPU"),
        "cpuinfo": cpu,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
    }


def measure(gguf: Path, model_dir: Path, variants: list[str], threads: int, peer: bool) -> dict[str, Any]:
    from models.convert.model import GGUFModel
    from models.convert.reference import ReferenceForward
    from models.runtime.tokenizer import Tokenizer

    ids = Tokenizer.load(model_dir).encode(TEXT, add_special_tokens=False)[:QUALITY_POSITIONS]
    t0 = time.perf_counter()
    forward = ReferenceForward(GGUFModel(gguf))
    ref = forward.logits(ids)
    forward.int8_activations = True
    int8 = forward.logits(ids)
    del forward
    report: dict[str, Any] = {
        "method": (
            "KL(P_fp32_reference || P_variant) per position, teacher-forced over "
            "studies/experiments/quality.py's TEXT, "
            "one token per forward pass; mean, p99, max; top-1 agreement with the reference"
        ),
        "gguf": gguf.name,
        "positions": len(ids),
        "threads": threads,
        **machine(),
        "reference_s": round(time.perf_counter() - t0, 1),
        # the same forward with every matmul input rounded as llama.cpp's CPU matmul rounds it for the
        # weight's type (int8 per 32- or 256-block, or half precision): llama.cpp's arithmetic
        "int8_reference": summarize(ref, int8),
        "variants": {},
    }
    for name in variants:
        t0 = time.perf_counter()
        logits = teacher_forced(variant_step(model_dir, name, threads), ids)
        report["variants"][name] = summarize(ref, logits) | {"seconds": round(time.perf_counter() - t0, 1)}
    step = llama_cpp_step(gguf, threads) if peer else None
    if step is not None:
        report["llama.cpp"] = summarize(ref, teacher_forced(step, ids))
    return report


def with_session_config(entries: dict[str, str]) -> None:
    """Every session this process opens gets these config entries too: which kernels onnxruntime picks (a
    session option such as KleidiAI's off switch) is part of what a variant's quality is on a CPU."""
    from models.runtime import session

    plain = session.session_options

    def options(threads: int, spinning: bool = False) -> Any:
        so = plain(threads, spinning)
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        return so

    session.session_options = options


def convert_into(gguf: Path, model_dir: Path, variants: list[str], threads: int) -> None:
    """The converter's files without its own measurement (this module measures), manifest last."""
    from models.convert.pipeline import convert

    model_dir.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.iterdir():  # an interrupted conversion: start over
        stale.unlink()
    manifest = convert(gguf, model_dir, variants=variants, measure=False, threads=threads)
    (model_dir / "manifest.json").write_text(json.dumps(manifest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.experiments.quality", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument(
        "--model-dir",
        type=Path,
        help="a converted folder, converted into first when it has no manifest.json (default: a temp one)",
    )
    p.add_argument("--variants", default="q4,q4-a8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp even when it is installed")
    p.add_argument("--json", type=Path, help="write the report here too")
    p.add_argument(
        "--session-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an onnxruntime session config entry for every variant's session (mlas.disable_kleidiai=1)",
    )
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.session_config:
        with_session_config(dict(kv.split("=", 1) for kv in args.session_config))
    with tempfile.TemporaryDirectory(prefix="simmer-quality-") as tmp:
        model_dir = args.model_dir or Path(tmp)
        if not (model_dir / "manifest.json").exists():
            convert_into(args.gguf, model_dir, variants, args.threads)
        report = measure(args.gguf, model_dir, variants, args.threads, peer=not args.no_peer)
    report["session_config"] = dict(kv.split("=", 1) for kv in args.session_config)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
