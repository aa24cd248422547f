"""The tokenizer alone: resident memory after loading it from a model folder, the peak while loading, the
time to encode a long message and to stream-decode its ids. Each folder is loaded in a fresh process,
folders alternate (A/B interleaved), and the ids of every folder must be equal.

    python -m bench.experiments.tokenizer_rss FOLDER [FOLDER ...] [--reps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 300_000


def messages() -> dict[str, str]:
    """Long messages: prose with code and specials, and two adversarial ones (random letters, CJK)."""
    rng = random.Random(1)
    parts = [
        "The quick brown fox jumps over the lazy dog. ",
        "  tabs\there\n\n",
        "Café résumé naïve ",
        "東京は日本の首都です。",
        "🙂🚀 ",
        "12345 678.9 ",
        "def f(x):\n    return x*2\n",
        "<start_of_turn>user\n",
    ]
    mixed = ""
    while len(mixed) < MESSAGE_CHARS:
        mixed += rng.choice(parts)
    letters = "".join(rng.choice("abcdefghij klmnop\u00e9\u4f60\u597d🙂,.\n") for _ in range(MESSAGE_CHARS))
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(MESSAGE_CHARS))
    return {"mixed": mixed[:MESSAGE_CHARS], "random_letters": letters, "random_cjk": cjk}


def probe(folder: str) -> dict[str, Any]:
    import hashlib
    import resource
    import time

    import psutil

    from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

    proc = psutil.Process()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    tok = Tokenizer.load(folder)
    out: dict[str, Any] = {
        "folder": folder,
        "compact": tok.spm is not None,
        "load_s": round(time.perf_counter() - t0, 3),
        "rss_before_mb": round(before / 1e6, 1),
        "rss_growth_mb": round((proc.memory_info().rss - before) / 1e6, 1),
        # ru_maxrss: KiB on Linux; the imports before loading are in it too
        "peak_growth_mb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6 - before / 1e6, 1
        ),
    }
    for name, text in messages().items():
        t0 = time.perf_counter()
        ids = tok.encode(text)
        out[f"encode_{name}_s"] = round(time.perf_counter() - t0, 3)
        out[f"ids_{name}"] = len(ids)
        out[f"ids_{name}_sha256"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
        if name == "mixed":
            detok = IncrementalDetokenizer(tok)
            t0 = time.perf_counter()
            for i in ids[:20_000]:
                detok.feed(i)
            out["stream_decode_20k_ids_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    t0 = time.perf_counter()
    for _ in range(1000):
        tok.encode("The capital of France is")
    out["encode_short_us"] = round((time.perf_counter() - t0) * 1000, 1)
    out["rss_growth_after_encodes_mb"] = round((proc.memory_info().rss - before) / 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folders", nargs="+")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    runs = []
    for _ in range(args.reps):
        for folder in args.folders:
            done = subprocess.run(
                [sys.executable, "-m", "bench.experiments.tokenizer_rss", "--probe", folder],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    digests = {k for r in runs for k in r if k.endswith("_sha256")}
    same = all(len({r[k] for r in runs}) == 1 for k in digests)
    report = {"bench": "tokenizer_rss", "message_chars": MESSAGE_CHARS, "same_ids": same, "runs": runs}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        print(json.dumps(probe(sys.argv[2])))
    else:
        sys.exit(main())
