"""simmer's side of `simmer bench cpu-cost`: the guest program whose instructions are counted.

    python -m bench.cpu_cost.guest --model-dir DIR --variant q4 --ids 1,2,3 --decode N

Opens the model folder with one thread, runs the prompt's ids as one prefill, then N greedy decode steps, one
token each (no speculation: llama_count.cpp decodes one token per step too). Before the prefill, after it and
after every decode step it makes a marker, close(MARK_FD), which the counter plugin (insn_count.c) records;
the generated ids go to stdout. Each marker's time goes to stderr: natively (`--cpu native`) the time is
what is measured; under qemu only the count means something.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

MARK_FD = 0x51EE7  # insn_count.c's: an fd no process has, so close() fails and does nothing else
TIMES: list[int] = []  # perf_counter_ns at each marker: natively (--cpu native) the time is the measure


def mark() -> None:
    TIMES.append(time.perf_counter_ns())
    with contextlib.suppress(OSError):  # EBADF, as intended: the syscall is the marker
        os.close(MARK_FD)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_cost.guest")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--ids", required=True, help="the prompt's token ids, comma-separated")
    ap.add_argument("--decode", type=int, required=True, help="decode steps after the prefill")
    args = ap.parse_args(argv)

    from models.protocol import Prompt
    from models.runtime.engine import load_engine
    from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent

    ids = [int(x) for x in args.ids.split(",")]
    engine = load_engine(
        args.model_dir,
        variant=args.variant,
        threads=1,
        context_length=512,
        spin="off",
        speculation="off",
    )
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=args.decode + 1, ignore_eos=True)
    out: list[int] = []
    mark()
    # The first token comes from the prefill, each later one from one decode step: a marker after each.
    for ev in engine.generate(Prompt(ids), params):
        if isinstance(ev, FinishEvent):
            break
        if not isinstance(ev, TokenEvent):
            continue
        mark()
        out.append(ev.token_id)
    # the tokens each decode step was fed (llama_count prints the same), and the markers' times
    print(",".join(str(t) for t in out[:-1]) if len(out) > 1 else "")
    print("times " + ",".join(str(t - TIMES[0]) for t in TIMES), file=sys.stderr)


if __name__ == "__main__":
    main()
