"""Which variant a model opens on, from the quality measured on the machine that pulled it.

`q4-a8` (int8 activations: the fastest decode) is the nominal variant where its error is the error of int8
activations themselves: its KL from the fp32 reference within NOMINAL_KL_FACTOR of the KL that the same
reference has when every matmul's input is rounded to int8 per 32-block (ReferenceForward with
`int8_activations`: llama.cpp's arithmetic, and onnxruntime's on x86, computed exactly on any machine).
onnxruntime picks its int8 kernels by the CPU: on ARM cores with the dot product it quantizes each row of
activations on one scale (KleidiAI's `qai8dx` kernels), which costs several times that error. There the
exact variant `q4` (the GGUF's blocks, fp32 activations) opens the model instead, and the governor's ladder
still steps down to `q4-a8` when the device must save heat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from models.types import NOMINAL_VARIANT

EXACT_VARIANT = "q4"
# q4-a8 on x86 measured 1.12x the int8 reference's KL (SmolLM2, docs/arm64.md); room for rounding and for
# kernels that block differently, well below what a per-row activation scale costs
NOMINAL_KL_FACTOR = 1.5


def kl_rows(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) of each row's softmax, in nats (float64)."""

    def log_softmax(a: np.ndarray) -> np.ndarray:
        a = a.astype(np.float64)
        a = a - a.max(axis=-1, keepdims=True)
        return a - np.log(np.exp(a).sum(axis=-1, keepdims=True))

    ref_lp, new_lp = log_softmax(ref_logits), log_softmax(logits)
    return np.maximum(0.0, (np.exp(ref_lp) * (ref_lp - new_lp)).sum(axis=-1))


def kl_mean(ref_logits: Sequence[np.ndarray], logits: Sequence[np.ndarray]) -> float:
    """The mean KL over every position of several sequences."""
    rows = [kl_rows(r, x) for r, x in zip(ref_logits, logits, strict=True)]
    return float(np.concatenate(rows).mean())


def choose_nominal(
    names: Sequence[str], entries: Mapping[str, Mapping[str, Any]], int8_kl: float | None
) -> tuple[str, str]:
    """(the variant a model opens on, why). Without both measurements q4-a8 stays nominal."""
    if NOMINAL_VARIANT not in names:
        return names[-1], f"no {NOMINAL_VARIANT}"
    kl = entries.get(NOMINAL_VARIANT, {}).get("quality", {}).get("kl_mean")
    if kl is None or int8_kl is None:
        return NOMINAL_VARIANT, "quality not measured"
    budget = NOMINAL_KL_FACTOR * int8_kl
    if kl <= budget or EXACT_VARIANT not in names:
        return NOMINAL_VARIANT, f"{NOMINAL_VARIANT} KL {kl:.3g} <= {budget:.3g} on this CPU"
    return EXACT_VARIANT, (
        f"{NOMINAL_VARIANT} KL {kl:.3g} > {budget:.3g} ({NOMINAL_KL_FACTOR}x int8 activations' own "
        f"{int8_kl:.3g}) on this CPU: its int8 kernels round more coarsely"
    )
