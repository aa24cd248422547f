"""Memory once warm, in one process and without the thermal simulator: the ladder benchmark's window.

One engine (default SmolLM2 q4-a8), a reply on 2 threads, the governor's change to 1 thread (a session
rebuilt while the old one is alive), then the sustained benchmark's completions (seeded, 160 tokens each).
After each reply: RSS by kind of mapping (/proc/self/smaps: the weights file, the heap, anonymous) and
glibc's bytes in use (mallinfo2). Linux and glibc only.

    SIMMER_HOME=... python -m bench.experiments.warm_memory --model-dir <folder> [--replies 20]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from bench.memory import heap_in_use, smaps_rss
from bench.sustained import MAX_TOKENS, PROMPTS
from models.protocol import EngineLimits
from models.types import GenerationParams, SamplingParams, TokenEvent
from server.engine_config import EngineConfig
from server.settings import Settings


def rss_by_kind(smaps: Path = Path("/proc/self/smaps")) -> collections.Counter:
    """Resident kB per kind: weights (a model's weights.data), heap, anon, file (libraries, tokenizers)."""
    by: collections.Counter = collections.Counter()
    for name, kib in smaps_rss(smaps).items():
        if name == "[heap]":
            by["heap"] += kib
        elif name.endswith("/weights.data"):
            by["weights"] += kib
        else:
            by["file" if name.startswith("/") else "anon"] += kib
    return by


def run(model_dir: Path, replies: int, variant: str | None) -> dict:
    engine = EngineConfig.from_settings(Settings(), threads=2).open_dir(model_dir, variant=variant)

    def reply(i: int) -> int:
        prompt = engine.text_prompt(f"Question: {PROMPTS[i % len(PROMPTS)]}\nAnswer:")
        sampling = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=i)
        params = GenerationParams(sampling, max_tokens=MAX_TOKENS, ignore_eos=True)
        return sum(isinstance(e, TokenEvent) for e in engine.generate(prompt, params))

    engine.apply_limits(EngineLimits(threads=2, context_cap=1024))
    reply(0)
    engine.apply_limits(EngineLimits(threads=1, context_cap=1024))  # the governor's thread change
    prev, prev_use = rss_by_kind(), heap_in_use()
    rows = []
    for i in range(1, replies + 1):
        tokens = reply(i)
        cur, use = rss_by_kind(), heap_in_use()
        rows.append(
            {
                "reply": i,
                "tokens": tokens,
                "rss_mb": round(sum(cur.values()) / 1024, 2),
                "grown_kb": {k: cur[k] - prev[k] for k in sorted(set(cur) | set(prev)) if cur[k] != prev[k]},
                "heap_in_use_grown_kb": (use - prev_use) >> 10,
            }
        )
        prev, prev_use = cur, use
    rss = [r["rss_mb"] for r in rows]
    end = min(11, len(rss))
    return {
        "model": f"{model_dir.parent.name}/{model_dir.name}",  # the store's id/folder, not a local path
        "replies": rows,
        "growth_mb_reply_1_to_11": round(rss[end - 1] - rss[0], 2),
        "weights_grown_kb_after_reply_1": sum(r["grown_kb"].get("weights", 0) for r in rows[1:]),
        "heap_in_use_grown_kb_after_reply_1": sum(r["heap_in_use_grown_kb"] for r in rows[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.warm_memory")
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--variant")
    p.add_argument("--replies", type=int, default=20)
    a = p.parse_args()
    print(json.dumps(run(a.model_dir, a.replies, a.variant), indent=1))


if __name__ == "__main__":
    main()
