"""One process, one variant and thread count, speculation off and on interleaved task by task:

    python -m bench.workload_probe '{"model_dir": ..., "variant": "q4", "threads": 1, "workload": "rewrite"}'
prints one JSON object. Both engines run in this process on the same files, so the machine's drift (15-20 %
over minutes here) falls on both alike; the order alternates every round. Greedy, up to `max_tokens` per
task, stopping at EOS: the replies must be token for token the same, and the report says whether they were.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("off", "auto")
MAX_TOKENS = 160
N_CTX = 2048


def _run(engine: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from models.protocol import Prompt
    from models.types import FinishEvent, GenerationParams, SamplingParams

    engine.reset_cache()  # every task from a cold KV: prefix reuse is not what this measures
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens)
    out: list[int] = []
    fin = None
    c0 = time.process_time()
    for ev in engine.generate(Prompt(list(ids)), params):
        if isinstance(ev, FinishEvent):
            fin = ev
        else:
            out.append(ev.token_id)
    cpu = time.process_time() - c0
    assert fin is not None
    t = fin.timings
    return {
        "tokens": out,
        "decode_s": t.predicted_ms / 1000,
        "cpu_s": cpu,  # the whole request, prefill included, all threads
        "draft_n": t.draft_n,
        "draft_n_accepted": t.draft_n_accepted,
    }


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    from bench.workloads import workload_prompts
    from models.runtime.engine import load_engine

    model_dir = Path(cfg["model_dir"])
    engines = {
        mode: load_engine(
            model_dir,
            variant=cfg["variant"],
            threads=cfg["threads"],
            context_length=int(cfg.get("n_ctx", N_CTX)),
            speculation=mode,
        )
        for mode in MODES
    }
    speculates = engines["auto"].speculates
    prompts = workload_prompts(model_dir, cfg["workload"])
    if cfg.get("prompt_tail"):  # a model with a short context (the tests' tiny one): the prompts' tails
        prompts = {name: ids[-int(cfg["prompt_tail"]) :] for name, ids in prompts.items()}
    max_tokens = int(cfg.get("max_tokens", MAX_TOKENS))
    for mode in MODES:  # warm-up
        _run(engines[mode], next(iter(prompts.values()))[:64], 8)
    totals = {
        m: {"tokens": 0, "decode_s": 0.0, "cpu_s": 0.0, "draft_n": 0, "draft_n_accepted": 0} for m in MODES
    }
    identical = True
    tasks: dict[str, Any] = {}
    for rep in range(int(cfg.get("reps", 1))):
        for i, (name, ids) in enumerate(prompts.items()):
            order = MODES if (rep + i) % 2 == 0 else MODES[::-1]
            runs = {mode: _run(engines[mode], ids, max_tokens) for mode in order}
            same = runs["off"]["tokens"] == runs["auto"]["tokens"]
            identical &= same
            for mode, r in runs.items():
                tot = totals[mode]
                tot["tokens"] += len(r["tokens"])
                for key in ("decode_s", "cpu_s", "draft_n", "draft_n_accepted"):
                    tot[key] += r[key]
            tasks.setdefault(name, []).append(
                {
                    "tokens": len(runs["off"]["tokens"]),
                    "identical": same,
                    "sha1_off": hashlib.sha1(json.dumps(runs["off"]["tokens"]).encode()).hexdigest()[:12],
                    "decode_tok_s": {
                        m: round(len(r["tokens"]) / max(r["decode_s"], 1e-9), 1) for m, r in runs.items()
                    },
                    "acceptance": round(
                        runs["auto"]["draft_n_accepted"] / max(runs["auto"]["draft_n"], 1), 3
                    ),
                }
            )
    res: dict[str, Any] = {
        "config": cfg,
        "speculates": speculates,
        "identical_tokens": identical,
        "tasks": tasks,
    }
    for mode, tot in totals.items():
        res[mode] = {
            "tokens": tot["tokens"],
            "decode_tok_s": round(tot["tokens"] / max(tot["decode_s"], 1e-9), 2),
            "tokens_per_cpu_s": round(tot["tokens"] / max(tot["cpu_s"], 1e-9), 2),
            "draft_n": tot["draft_n"],
            "draft_n_accepted": tot["draft_n_accepted"],
            "acceptance": round(tot["draft_n_accepted"] / tot["draft_n"], 3) if tot["draft_n"] else None,
        }
    res["speculation_speedup"] = round(res["auto"]["decode_tok_s"] / res["off"]["decode_tok_s"], 3)
    res["speculation_cpu_ratio"] = round(res["auto"]["tokens_per_cpu_s"] / res["off"]["tokens_per_cpu_s"], 3)
    return res


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
