"""Tokens per CPU-second of decode, free-running and paced as the governor paces, per thread/spin setting.

Under a thermal cap the device sustains a fixed number of busy cores, so the tokens a governor gets are
that envelope times the tokens per CPU-second of the process (all its threads: a spinning pool counts).
This probe measures that number for each configuration of each installed model, in one process,
interleaved round by round (the machine's speed drifts), and reports medians and ratios against the
1-thread configuration of the same model:

- t2-spin: 2 intra-op threads whose pool spins between runs (what SIMMER_SPIN=on gives, and auto unpaced)
- t2-spin-stop: 2 threads spinning inside a run, stopped as the run returns (onnxruntime's session option
  session.force_spinning_stop): the spin's speed within a pass without burning the gaps between passes
- t2-quiet: 2 threads, no spinning (SIMMER_SPIN=off, and auto paced)
- t1: 1 thread (no pool: nothing to spin)

Each runs free (token after token) and paced: after every forward pass the step hook idles `idle` times
the pass, as the gate idles to hold a pace (server/governor_gate.decide_step); 0.15 is about a serious
level's budget on the phone profile (0.87 busy cores at one thread).

    python -m studies.experiments.pace_probe --home DIR --models gemma3-270m,smollm2-135m-instruct \
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

CONFIGS = (("t2-spin", 2, "on"), ("t2-spin-stop", 2, "on+stop"), ("t2-quiet", 2, "off"), ("t1", 1, "off"))
PROMPT = "Question: Explain why the sky is blue in a few sentences.\nAnswer:"


class Pacer:
    """A step hook that idles `idle` times each forward pass after it (the gate's pace, by duty cycle)."""

    def __init__(self, idle: float) -> None:
        self.idle = idle
        self.last: float | None = None

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.last is not None and self.idle > 0:
            time.sleep((now - self.last) * self.idle)
        self.last = time.perf_counter()


@contextlib.contextmanager
def stop_spinning_after_run(on: bool) -> Iterator[None]:
    """Sessions made inside also set session.force_spinning_stop (the engine opens its session at once)."""
    from models.runtime import session

    plain = session.session_options

    def with_stop(threads: int, spinning: bool = False) -> Any:
        so = plain(threads, spinning)
        so.add_session_config_entry("session.force_spinning_stop", "1")
        return so

    if on:
        session.session_options = with_stop  # type: ignore[assignment]
    try:
        yield
    finally:
        session.session_options = plain  # type: ignore[assignment]


def decode(engine: Any, ids: list[int], n: int, idle: float) -> tuple[int, float, float]:
    """(tokens, wall s, process CPU s) from the first token to the last of one greedy reply."""
    from models.protocol import Prompt
    from models.types import FinishEvent, GenerationParams, SamplingParams

    engine.reset_cache()
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
    hook = Pacer(idle) if idle > 0 else None
    tokens = 0
    w0 = c0 = 0.0
    for ev in engine.generate(Prompt(list(ids)), params, step_hook=hook):
        if isinstance(ev, FinishEvent):
            break
        tokens += 1
        if tokens == 1:
            w0, c0 = time.perf_counter(), time.process_time()
    return tokens - 1, time.perf_counter() - w0, time.process_time() - c0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m-instruct")
    ap.add_argument("--variant", default="q4-a8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--idle", type=float, default=0.15)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    os.environ["SIMMER_HOME"] = args.home  # before Settings() reads it (the probe's own process)
    from server.serving.engine_config import EngineConfig
    from server.settings import Settings

    base = EngineConfig.from_settings(Settings(), threads=2)
    engines: dict[tuple[str, str], Any] = {}
    prompts: dict[str, list[int]] = {}
    for model in args.models.split(","):
        for name, threads, spin in CONFIGS:
            cfg = replace(base, threads=threads, spin=spin.split("+")[0])
            with stop_spinning_after_run(spin.endswith("+stop")):
                engine = cfg.open_installed(model, variant=args.variant)
            engines[(model, name)] = engine
            prompts[model] = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
            decode(engine, prompts[model], 8, 0.0)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {}
    keys = list(engines)
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate: no configuration always first
        for model, name in order:
            for mode, idle in (("free", 0.0), ("paced", args.idle)):
                n, wall, cpu = decode(engines[(model, name)], prompts[model], args.tokens, idle)
                runs.setdefault(f"{model}:{name}:{mode}", []).append(
                    {"tok_s": n / wall, "tok_per_cpu_s": n / cpu, "busy_cores": cpu / wall}
                )
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary: dict[str, Any] = {}
    for key, rs in runs.items():
        summary[key] = {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
        summary[key]["tok_per_cpu_s_all"] = [round(x["tok_per_cpu_s"], 2) for x in rs]
    for key, s in summary.items():
        model, _, mode = key.split(":")
        ref = summary[f"{model}:t1:{mode}"]["tok_per_cpu_s"]
        s["tok_per_cpu_s_vs_t1"] = round(s["tok_per_cpu_s"] / ref, 3)
    report = {
        "benchmark": "pace-probe",
        "variant": args.variant,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "paced_idle_per_pass": args.idle,
        "host": {"cpus": os.cpu_count(), "loadavg_1_5_15_end": [round(x, 2) for x in os.getloadavg()]},
        "summary": summary,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
