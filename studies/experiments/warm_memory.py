"""Memory once warm, in one process and without the thermal simulator: the ladder benchmark's window.

One engine (default SmolLM2 q4-a8) on a worker thread, as the server runs it (glibc gives a thread its own
malloc arena): a warm-up reply on 2 threads, then the sustained benchmark's completions (seeded, 160 tokens
each), the first of which meets the governor's change to 1 thread mid-reply, through the step hook, as the
server's worker applies it (a session rebuilt inside a reply). After each reply: RSS by kind of mapping
(/proc/self/smaps: the weights file, the heap, anonymous) and glibc's bytes in use (mallinfo2). Linux and
glibc only.

    SIMMER_HOME=... python -m studies.experiments.warm_memory --model-dir <folder> [--replies 20] \
        [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
from pathlib import Path
from typing import Any

from bench.memory import heap_in_use, smaps_rss
from bench.sustained.client import MAX_TOKENS, PROMPTS
from models.protocol import EngineLimits
from models.types import GenerationParams, SamplingParams, TokenEvent
from server.serving.engine_config import EngineConfig
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


CHANGE_AFTER_STEPS = 16  # the step hook's call (prefill chunks, then tokens) that brings the thread change


def run(model_dir: Path, replies: int, variant: str | None, max_tokens: int = MAX_TOKENS) -> dict:
    """On a worker thread (see the module doc); the result, or the worker's exception re-raised."""
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["result"] = _run(model_dir, replies, variant, max_tokens)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=work, name="simmer-worker")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _run(model_dir: Path, replies: int, variant: str | None, max_tokens: int) -> dict:
    engine = EngineConfig.from_settings(Settings(), threads=2).open_dir(model_dir, variant=variant)
    steps = 0

    def change_threads() -> EngineLimits | None:
        nonlocal steps
        steps += 1
        return EngineLimits(threads=1, context_cap=1024) if steps == CHANGE_AFTER_STEPS else None

    def reply(i: int, hook=None) -> int:
        prompt = engine.text_prompt(f"Question: {PROMPTS[i % len(PROMPTS)]}\nAnswer:")
        sampling = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=i)
        params = GenerationParams(sampling, max_tokens=max_tokens, ignore_eos=True)
        events = engine.generate(prompt, params, step_hook=hook)
        return sum(isinstance(e, TokenEvent) for e in events)

    engine.apply_limits(EngineLimits(threads=2, context_cap=1024))
    reply(0)  # warm: the session, its arena and the KV buffer are there
    warm, warm_use = rss_by_kind(), heap_in_use()
    prev, prev_use = warm, warm_use
    rows = []
    for i in range(1, replies + 1):
        tokens = reply(i, change_threads if i == 1 else None)
        cur, use = rss_by_kind(), heap_in_use()
        rows.append(
            {
                "reply": i,
                "tokens": tokens,
                "threads": engine.threads,
                "rss_mb": round(sum(cur.values()) / 1024, 2),
                "grown_kb": {k: cur[k] - prev[k] for k in sorted(set(cur) | set(prev)) if cur[k] != prev[k]},
                "heap_in_use_grown_kb": (use - prev_use) >> 10,
            }
        )
        prev, prev_use = cur, use
    end = rows[min(10, len(rows)) - 1]
    return {
        "model": f"{model_dir.parent.name}/{model_dir.name}",  # the store's id/folder, not a local path
        "replies": rows,
        "rss_mb_warm": round(sum(warm.values()) / 1024, 2),
        # the window: ten replies after the warm-up, the first of which changes the threads mid-reply
        "growth_mb_warm_to_reply_10": round(end["rss_mb"] - sum(warm.values()) / 1024, 2),
        "weights_grown_kb_after_reply_1": sum(r["grown_kb"].get("weights", 0) for r in rows[1:]),
        "heap_in_use_grown_kb_after_reply_1": sum(r["heap_in_use_grown_kb"] for r in rows[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m studies.experiments.warm_memory")
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--variant")
    p.add_argument("--replies", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    a = p.parse_args()
    print(json.dumps(run(a.model_dir, a.replies, a.variant, a.max_tokens), indent=1))


if __name__ == "__main__":
    main()
