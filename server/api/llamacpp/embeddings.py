"""llama.cpp's /embedding answer: a JSON array with, per input, `{"index": i, "embedding": [[floats]]}`
(a pooled model's one vector, in a list of one: llama.cpp's non-OpenAI reply), each vector normalised as
`embd_normalize` asks (llama.cpp's common_embd_normalize).

The encoder's graph ends in its L2 normalisation (the sentence-transformers module). Every normalisation
llama.cpp offers but "none" divides the vector by a norm of itself, so it is the same whether applied to the
raw pooled vector or to its unit-length copy: those are exact here. `-1` (none) would need the vector before
the graph's normalisation, which the graph does not give: it is refused (a 400) rather than answered wrong.
"""

from __future__ import annotations

import numpy as np

from models.errors import InvalidParameter
from server.api.common.embeddings import rows_json
from server.serving.embedding import Embedded

NO_NORMALISATION = -1


def check_normalize(value: int, normalised: bool) -> None:
    if value == NO_NORMALISATION and normalised:
        raise InvalidParameter(
            "embd_normalize -1 (no normalisation) is not available: this model's vectors come out of its "
            "graph normalised; use 2 (Euclidean, the default), 1, 0 or a p-norm above 2",
            param="embd_normalize",
        )


def normalised(rows: np.ndarray, how: int) -> np.ndarray:
    """Each row divided by its norm as llama.cpp's common_embd_normalize computes it: 0 the largest absolute
    value over 32760 (an int16 range), 1 the sum of absolute values, 2 the Euclidean norm, p > 2 the
    p-norm (computed as max * (sum (|x|/max)^p)^(1/p), which neither overflows nor underflows for a large
    p); a zero row stays zero. -1 leaves the rows as they are."""
    x = rows.astype(np.float64)
    if how == NO_NORMALISATION:
        return rows
    big = np.abs(x).max(axis=1, keepdims=True)
    if how == 0:
        norm = big / 32760.0
    elif how == 1:
        norm = np.abs(x).sum(axis=1, keepdims=True)
    elif how == 2:
        norm = np.sqrt((x * x).sum(axis=1, keepdims=True))
    else:
        scaled = np.abs(x) / np.where(big > 0, big, 1.0)
        norm = big * (scaled**how).sum(axis=1, keepdims=True) ** (1.0 / how)
    out = np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)
    return out.astype(np.float32)


def embedding_body(got: Embedded, how: int) -> bytes:
    """The JSON reply (a thread's work, as for the other dialects)."""
    rows = rows_json(normalised(got.vectors, how))  # a vector at a time, as for the other dialects
    return (
        "[" + ",".join(f'{{"index":{i},"embedding":[{row}]}}' for i, row in enumerate(rows)) + "]"
    ).encode()
