"""The same guests run natively, timed at their markers: the one CPU class measured, not counted.

Under qemu only a count means something; natively the markers' clock readings (each guest prints them to
stderr) give seconds per prompt token and per decoded token for the same work the counts are of. This
machine's own CPU (AVX-512 VNNI here) cannot be counted: qemu 7.2's TCG has no AVX-512.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from typing import Any


def marker_times(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800
) -> tuple[list[int], str]:
    """One native run: the markers' times (ns from the first) and the guest's stdout."""
    proc = subprocess.run(
        cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... exited {proc.returncode}: {proc.stderr[-1500:]}")
    line = next(x for x in proc.stderr.splitlines()[::-1] if x.startswith("times "))
    return [int(t) for t in line.split(" ", 1)[1].split(",")], proc.stdout.strip()


def timed_rounds(
    programs: list[tuple[list[str], dict[str, str] | None]], prompt_tokens: int, decode: int, reps: int
) -> list[dict[str, Any]]:
    """Each program `reps` times (one process each), interleaved round by round (a shared machine's load
    drifts over minutes); per program the median over runs of the prefill's and the decode's time per
    token, decode as (time after 2N steps - after N) / N like the counts."""
    half = decode // 2
    prompt: list[list[float]] = [[] for _ in programs]
    dec: list[list[float]] = [[] for _ in programs]
    tokens = [""] * len(programs)
    for _ in range(reps):
        for i, (cmd, env) in enumerate(programs):
            t, tokens[i] = marker_times(cmd, env)
            if len(t) != decode + 2:
                raise RuntimeError(f"expected {decode + 2} markers, got {len(t)}")
            prompt[i].append((t[1] - t[0]) / prompt_tokens)
            dec[i].append((t[1 + decode] - t[1 + half]) / half)
    out = []
    for i in range(len(programs)):
        ms_prompt, ms_decode = statistics.median(prompt[i]) / 1e6, statistics.median(dec[i]) / 1e6
        out.append(
            {
                "how": "timed",
                "reps": reps,
                "ms_per_prompt_token": round(ms_prompt, 3),
                "ms_per_decoded_token": round(ms_decode, 3),
                "prompt_tok_s": round(1000 / ms_prompt, 1),
                "decode_tok_s": round(1000 / ms_decode, 1),
                "ms_per_decoded_token_runs": [round(x / 1e6, 3) for x in dec[i]],
                "tokens": tokens[i],
            }
        )
    return out
