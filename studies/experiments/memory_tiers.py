"""Which model fits which memory tier: each model's resident memory as the server runs it, measured, beside
the memory planner's estimate and the budget at which a ladder starts on it. Prints JSON.

Each model in its own child process (a clean heap), opened the server's way (EngineConfig from Settings:
the context cap, the KV buffers prefaulted, the nominal variant): RSS and peak RSS (VmHWM) after the load,
then after a chat reply (the prompt prefilled, `--tokens` decoded). The planner's estimate is what the ladder
compares with the budget at start (server/serving/memory_plan.py); a rung is picked when the estimate plus the
headroom (20 % of the budget, the governor's memory "fair" threshold, at least SIMMER_MEMORY_RESERVE_MB)
fits: `min_budget_mib` is the smallest SIMMER_MEMORY_BUDGET_MB that starts on the model.

    SIMMER_HOME=... python -m studies.experiments.memory_tiers MODEL [MODEL ...] [--tokens 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from governor.policy import PolicyConfig
from server.serving.catalog import StoreCatalog
from server.serving.engine_config import EngineConfig
from server.serving.memory_plan import estimate
from server.settings import Settings

MiB = 1 << 20

CHILD = """
import json, sys, time
from server.serving.engine_config import EngineConfig
from server.settings import Settings
from models.types import GenerationParams, SamplingParams, TokenEvent

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

model, tokens = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
engine = EngineConfig.from_settings(Settings()).open_installed(model)
load_s = time.perf_counter() - t0
loaded = status()
prompt = engine.chat_prompt([{"role": "user", "content": "Write a Python function that reverses a list."}])
params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True)
n = sum(isinstance(e, TokenEvent) for e in engine.generate(prompt, params))
replied = status()
print(json.dumps({"variant": engine.variant, "context_length": engine.context_length, "load_s": load_s,
                  "loaded": loaded, "replied": replied, "tokens": n}))
"""


def measure(model: str, tokens: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(tokens)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def min_budget(total: int, reserve: int, fair: float) -> int:
    """The smallest budget B with total + max(reserve, fair * B) <= B (serving/model_setup.py's headroom)."""
    return max(total + reserve, math.ceil(total / (1 - fair)))


def run(models: list[str], tokens: int) -> dict[str, Any]:
    settings = Settings()
    config = EngineConfig.from_settings(settings)
    catalog = StoreCatalog(settings.home)
    fair = PolicyConfig().memory_fair_fraction
    rows = []
    for model in models:
        entry = catalog.get(model)
        if entry is None:
            raise SystemExit(f"{model} is not installed in {settings.home}")
        m = measure(model, tokens)
        est = estimate(
            entry.manifest,
            m["variant"],
            context_length=config.context_length,
            prefix_slots=config.prefix_slots,
            prefix_budget_bytes=config.prefix_budget_bytes,
        )
        need = min_budget(est.total, settings.memory_reserve_mb * MiB, fair)
        rows.append(
            {
                "model": model,
                "variant": m["variant"],
                "context_length": m["context_length"],
                "load_s": round(m["load_s"], 1),
                "rss_mib_loaded": round(m["loaded"]["VmRSS"] / MiB),
                "rss_mib_after_reply": round(m["replied"]["VmRSS"] / MiB),
                "peak_rss_mib": round(m["replied"]["VmHWM"] / MiB),
                "estimate_mib": round(est.total / MiB),
                "estimate": est.describe(),
                "min_budget_mib": math.ceil(need / MiB),
            }
        )
    return {
        "benchmark": "memory_tiers",
        "how": __doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else "",
        "tokens": tokens,
        "models": rows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.experiments.memory_tiers")
    p.add_argument("models", nargs="+")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    text = json.dumps(run(a.models, a.tokens), indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
