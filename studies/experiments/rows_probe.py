"""Is a verification pass exact on a variant, and what would an always-batched decode cost?

    python -m studies.experiments.rows_probe MODEL_DIR VARIANT [THREADS]

prints one JSON object (is q4-a8's verification pass exact? on the real graph):
- `one_vs_batch`: the logits of 1..M positions fed in one pass against the same positions fed one at a time
  (max |difference|, argmax flips), after a 40-token prefix;
- `batch_vs_batch`: the first two rows of an M-row pass against a 2-row pass (0.0: rows of passes with
  M >= 2 do not depend on M or on the rows after them);
- `padded_vs_batch`: single-token decode steps padded to two rows (a throwaway second token, overwritten
  next step), their first row against the rows of one 9-row pass;
- `pass_ms`: median time of an m-row pass at a ~220-token context, m = 1, 2, 3, 5 (rounds interleaved), and
  the cost of an extra row relative to a one-row pass.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def probe(
    model_dir: Path, variant: str, threads: int = 1, rounds: int = 40, context: int = 512
) -> dict[str, Any]:
    from models.runtime.engine import load_engine
    from models.runtime.session import DecoderSession, KVCache

    engine = load_engine(
        model_dir, variant=variant, threads=threads, context_length=context, speculation="off"
    )
    s = engine.session()
    assert isinstance(s, DecoderSession) and s.multi_logits, "needs a graph with num_logits_to_keep"
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, s.shape.vocab, 40)
    probe_ids = rng.integers(0, s.shape.vocab, 9)

    def fresh() -> KVCache:
        kv = KVCache(s.shape, context)
        s.run(prefix, kv, 0)
        return kv

    kv = fresh()
    alone = np.stack([s.run(probe_ids[i : i + 1], kv, len(prefix) + i).copy() for i in range(9)])
    rows = {}
    for m in (2, 3, 4, 8, 9):
        rows[m] = s.run_last(probe_ids[:m], fresh(), len(prefix), m).copy()
    kv = fresh()
    padded = np.stack(
        [s.run_last(np.array([t, 0]), kv, len(prefix) + i, 2)[0].copy() for i, t in enumerate(probe_ids)]
    )
    times: dict[int, list[float]] = {1: [], 2: [], 3: [], 5: []}
    kv = fresh()
    at = min(220, context - 60)  # the timed passes' context
    s.run(rng.integers(0, s.shape.vocab, at - len(prefix)), kv, len(prefix))
    for r in range(rounds):
        for m in times:
            ids = rng.integers(0, s.shape.vocab, m)
            t0 = time.perf_counter()
            s.run_last(ids, kv, at + r % 50, m)
            times[m].append(time.perf_counter() - t0)
    ms = {m: statistics.median(v) * 1000 for m, v in times.items()}
    return {
        "model_dir": str(model_dir),
        "variant": variant,
        "threads": threads,
        "one_vs_batch": {
            m: {
                "max_abs": float(np.abs(r - alone[:m]).max()),
                "argmax_flips": int((r.argmax(-1) != alone[:m].argmax(-1)).sum()),
            }
            for m, r in rows.items()
        },
        "batch_vs_batch": {m: float(np.abs(rows[m][:2] - rows[2]).max()) for m in (3, 4, 8, 9)},
        "padded_vs_batch": float(np.abs(padded - rows[9]).max()),
        "pass_ms": {m: round(v, 2) for m, v in ms.items()},
        "pass_vs_one_row": {m: round(v / ms[1], 3) for m, v in ms.items()},
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(probe(Path(args[0]), args[1], int(args[2]) if len(args) > 2 else 1), indent=1))
