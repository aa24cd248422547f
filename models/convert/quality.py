"""How far a variant's next-token distributions are from the fp32 reference of the same GGUF: KL divergence
and top-1 agreement, teacher-forced over one fixed text, one token per forward pass (the decode path users'
tokens take). The method of `llama-perplexity --kl-divergence`; llama.cpp itself is measured the same way on
the same token ids when llama-cpp-python is installed (`peer_logits`), so that the floor a re-encoded variant
must meet is this model's own, on this machine.

The text mixes prose, code, numbers, facts and a chat turn, and is long enough (QUALITY_POSITIONS tokens)
that no single position decides a mean: the statistics are the mean, a high quantile (p99) and the max.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

QUALITY_POSITIONS = 512
HIGH_QUANTILE = 0.99

QUALITY_TEXT = """\
The lighthouse keeper climbed the spiral stairs at dusk, as she had every evening for thirty-one years. \
The lamp needed oil, the lens needed wiping, and the logbook needed a line: wind from the north-west, \
visibility fair, two fishing boats returning late. She did not mind the routine. It gave the days a shape \
that the sea, with its endless variations, never could.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list in O(len(a) + len(b)).\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

Water boils at 100 degrees Celsius at sea level, and the boiling point drops by roughly one degree for \
every 300 metres of altitude. Mount Everest rises 8,849 metres above sea level; the Mariana Trench sinks \
to about 10,935 metres below it. The speed of light in a vacuum is 299,792,458 metres per second, and \
light from the Sun takes a little over eight minutes to reach the Earth.

<|im_start|>user
Can you explain what a hash table is, in two sentences?<|im_end|>
<|im_start|>assistant
A hash table stores key-value pairs in an array, using a hash function to turn each key into an index \
where its value lives. Lookups, insertions and deletions take constant time on average, as long as the \
table is not too full and the hash function spreads keys evenly.<|im_end|>

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC
LIMIT 10;

In 1869 Dmitri Mendeleev arranged the known elements by atomic weight and noticed that their properties \
repeated at regular intervals. He left gaps for elements not yet discovered and predicted their \
properties; when gallium, scandium and germanium were found in the following years, they fit his \
predictions closely. Today the periodic table has 118 confirmed elements, arranged by atomic number.

Recipe for a simple bread: mix 500 g of flour, 10 g of salt, 7 g of dried yeast and 350 ml of warm water. \
Knead for ten minutes, let the dough rise for an hour, shape it, let it rise again for forty minutes, \
then bake at 220 degrees for about thirty-five minutes, until the crust is golden and the loaf sounds \
hollow when tapped underneath.

for (let i = 1; i <= 15; i++) {
  if (i % 15 === 0) console.log("FizzBuzz");
  else if (i % 3 === 0) console.log("Fizz");
  else if (i % 5 === 0) console.log("Buzz");
  else console.log(i);
}

Les marées sont causées principalement par l'attraction gravitationnelle de la Lune et, dans une moindre \
mesure, du Soleil. Quand les deux astres sont alignés, les marées sont plus fortes : ce sont les marées \
de vives-eaux.

The committee met again on Thursday. After a long discussion about the budget, the members agreed to \
postpone the new library wing until the spring, to repair the roof of the old hall first, and to ask \
the town council for a grant that would cover at least half of the cost of both projects.
"""


def quality_ids(encode: Callable[[str], list[int]]) -> list[int]:
    """The fixed text's token ids, cut to QUALITY_POSITIONS + 1 (the last one is only ever a target)."""
    return list(encode(QUALITY_TEXT))[: QUALITY_POSITIONS + 1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_rows(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) of each row's softmax, in nats (float64): Comparison's measure, for whole arrays."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return np.maximum(0.0, (np.exp(lp) * (lp - lq)).sum(axis=-1))


class Comparison:
    """Accumulates, position by position, KL(reference || candidate) and whether the argmaxes agree."""

    def __init__(self) -> None:
        self.kl: list[float] = []
        self.agree: list[bool] = []

    def add(self, ref_logits: np.ndarray, logits: np.ndarray) -> None:
        lp, lq = log_softmax(ref_logits), log_softmax(logits)
        self.kl.append(max(0.0, float(np.sum(np.exp(lp) * (lp - lq)))))
        self.agree.append(bool(np.argmax(ref_logits) == np.argmax(logits)))

    def summary(self, method: str) -> dict[str, Any]:
        kl = np.asarray(self.kl)
        return {
            "kl_mean": float(f"{kl.mean():.6g}"),
            "kl_p99": float(f"{np.quantile(kl, HIGH_QUANTILE):.6g}"),
            "kl_max": float(f"{kl.max():.6g}"),
            "top1_agreement": round(float(np.mean(self.agree)), 4),
            "positions": len(kl),
            "method": method,
        }


def compare(ref_logits: np.ndarray, step: Callable[[int, int], np.ndarray], ids: Sequence[int]) -> Comparison:
    """Feed ids[pos] at position pos through `step(token, pos)` (the logits after it) for every position
    the reference has, and compare each with the reference's row."""
    c = Comparison()
    for pos in range(len(ref_logits)):
        c.add(ref_logits[pos], step(int(ids[pos]), pos))
    return c


METHOD = (
    "teacher-forced over the fixed quality text ({n} positions), one token per forward pass, "
    "KL(fp32 reference || variant) per position in float64"
)
PEER_METHOD = (
    "llama.cpp (llama-cpp-python {version}, {threads} threads, one token per llama_decode) on the same "
    "GGUF and token ids, teacher-forced: KL(fp32 reference || llama.cpp) per position in float64"
)


def peer_logits(
    gguf: Path, ids: Sequence[int], positions: int, threads: int
) -> tuple[Callable[[int, int], np.ndarray], str, Callable[[], None]] | None:
    """llama.cpp's next-token logits on the same GGUF, one token per call, when llama-cpp-python is
    installed: (step(token, pos), how it was measured, close) or None without it."""
    try:
        import llama_cpp  # pyright: ignore[reportMissingImports]  (an optional peer)
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        str(gguf),
        n_ctx=positions + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=1,
        n_ubatch=1,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def step(token: int, pos: int) -> np.ndarray:
        llm.n_tokens = pos  # eval() continues after n_tokens
        llm.eval([token])
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()

    def close() -> None:
        llm.close()

    version = getattr(llama_cpp, "__version__", "?")
    return step, PEER_METHOD.format(version=version, threads=threads), close
