"""The encoder's int8 variant measured against the exact one on the machine that converts the model, as the
decoders' variants are (models/convert/quality.py): what it keeps of the embeddings, what it costs.

**Quality**: the cosine of each int8 embedding to the f32 one (the f32 graph is sentence-transformers' fp32
output to 2e-8: docs/models.md) over SENTENCES (fixed, built in: short and long, plain and technical, a few
languages). The floor is on the worst sentence, not the mean: a search index is as good as its worst
vector. all-MiniLM-L6-v2's int8 measures 0.99941 (mean 0.99984) on AVX-512 VNNI.
**Speed**: sentences per CPU-second over SENTENCES in batches of 32 (as the decoders' variants are timed:
the cost to a phone's battery, and less at the mercy of other processes than the wall clock), the variants
timed in alternation (ROUNDS rounds, the best of each kept).
**The nominal variant** is f32, whatever was measured: all-MiniLM-L6-v2's int8 ran 1.00-1.17x f32's
sentences per CPU-second from one pull to the next (2 threads, AVX-512 VNNI, a shared machine), a spread
a pull must not choose on, and with fp32 activations (where int8 ones miss the floor) 0.80x. int8 is what a
device short of memory asks for (SIMMER_VARIANT=int8): 60 MB of weights to f32's 90 MB.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.convert.encoder_config import F32, INT8

FLOOR = 0.999  # min cosine of each sentence's int8 embedding to its f32 one
ROUNDS = 3
THREADS = 2
BATCH = 32
NOMINAL = F32
NOMINAL_REASON = "the exact variant: int8 is not clearly faster (its speed is within the rounds' spread)"

SENTENCES = (
    "hello world",
    "The cat sat on the mat.",
    "A man is eating food.",
    "A man eats a meal.",
    "The stock market fell sharply after the announcement.",
    "How do I reset my password?",
    "Where is the nearest train station?",
    "The quick brown fox jumps over the lazy dog.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The committee postponed its decision on the new tax proposal until next spring.",
    "My grandmother's recipe for lemon cake uses three eggs and a cup of sugar.",
    "The satellite's orbit decays slowly because of drag in the upper atmosphere.",
    "Install the package with pip and import it in your script.",
    "def add(a, b): return a + b",
    "Error: connection refused on port 8080",
    "SELECT name, price FROM products WHERE price > 10 ORDER BY price;",
    "The patient reported a mild headache and a fever of 38.5 degrees.",
    "Interest rates were raised by a quarter of a percentage point.",
    "She played the violin at the concert in Vienna last night.",
    "The football match ended in a draw after extra time.",
    "Ein Satz auf Deutsch, mit Umlauten: Grüße!",
    "Le chat dort sur le canapé depuis ce matin.",
    "El tren sale a las ocho de la mañana.",
    "Simmer serves small language models on phones, under a thermal governor.",
    "Rain is expected this weekend, with strong winds along the coast.",
    "The museum is closed on Mondays and public holidays.",
    "Our team shipped the release two days ahead of schedule.",
    "Neural networks learn representations from large amounts of data.",
    "The old fisherman repaired his nets before sunrise.",
    "Please send the invoice to the accounting department by Friday.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "ok",
    "Sentence embeddings map texts with similar meanings to nearby vectors, so that a query finds the "
    "documents that answer it even when they share few words with it; the vectors are compared by cosine "
    "similarity, and an index of millions of them can be searched in milliseconds.",
    "The contract may be terminated by either party with thirty days' written notice, provided that all "
    "outstanding invoices have been settled and that no work in progress remains unfinished at that date.",
)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def embed_all(emb: Any, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """The rows' vectors in batches of BATCH (an Embedder's `embed` takes at most MAX_BATCH rows)."""
    return np.concatenate([emb.embed(rows[i : i + BATCH]) for i in range(0, len(rows), BATCH)])


def measure_quality(folder: Path) -> dict[str, Any]:
    """int8 against f32 in `folder`: {min_cosine, mean_cosine, method}."""
    from models.runtime.embedder import Embedder

    exact = Embedder(folder, threads=THREADS, variant=F32)
    rows = exact.tokenize(SENTENCES, fit=True)
    cos = cosines(embed_all(Embedder(folder, threads=THREADS, variant=INT8), rows), embed_all(exact, rows))
    return {
        "min_cosine": round(float(cos.min()), 6),
        "mean_cosine": round(float(cos.mean()), 6),
        "method": f"cosine to f32's embedding over {len(rows)} built-in sentences",
    }


def measure_speed(folder: Path, variants: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{variant: {sentences_per_cpu_s, method}}, the variants timed in alternation."""
    from models.runtime.embedder import Embedder

    embs = {name: Embedder(folder, threads=THREADS, variant=name) for name in variants}
    rows = next(iter(embs.values())).tokenize(SENTENCES, fit=True)
    for emb in embs.values():  # the first pass of a session pays for its allocations
        embed_all(emb, rows)
    rates: dict[str, list[float]] = {name: [] for name in embs}
    for _ in range(ROUNDS):
        for name, emb in embs.items():
            start = time.process_time()
            embed_all(emb, rows)
            rates[name].append(len(rows) / max(time.process_time() - start, 1e-6))
    method = f"batches of {BATCH}, {THREADS} threads, best of {ROUNDS} rounds in alternation"
    return {name: {"sentences_per_cpu_s": round(max(r), 1), "method": method} for name, r in rates.items()}


def check(quality: Mapping[str, Any], floor: float | None = None) -> str | None:
    """None when int8's measured quality is within the floor (FLOOR unless given), else why not (for the log
    and the manifest)."""
    floor = FLOOR if floor is None else floor
    low = quality.get("min_cosine")
    if not isinstance(low, int | float):
        return "its cosine to f32 was not measured"
    return None if low >= floor else f"min cosine {low:.5f} < {floor}"
