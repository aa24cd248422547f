"""The quality floor a re-encoded variant must meet to be installed: never further from the fp32 reference
than llama.cpp is on the same GGUF, measured on this machine at pull time (models/convert/quality.py), in
the mean and in a high quantile of the per-position KL both, so that neither a single outlier position nor
a broad shift decides alone.

Without llama.cpp to measure, a fixed budget stands in, taken from llama.cpp's own KL on the models
measured for it (teacher-forced, same method, onnxruntime 1.32 / llama-cpp-python 0.3.36):
| model (GGUF) | llama.cpp KL mean | p99 |
|---|---|---|
| SmolLM2-135M Q4_1 | 0.00264 | |
| Gemma 3 270M Q4_K_M | 0.0152 | |
| Qwen2.5-Coder-0.5B Q4_K_M | 0.00076 | |
| Qwen2.5-Coder-1.5B Q4_K_M | 0.0307 | 0.0105 |
The budget is the strictest of them, the smallest mean and the one quantile: a re-encoded variant installed
without the peer's measurement is then as close to its reference as llama.cpp came on any of these models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FALLBACK_KL_MEAN = 0.00076
FALLBACK_KL_P99 = 0.0105
FALLBACK_METHOD = (
    "no llama.cpp to measure: a fixed budget, the smallest KL llama.cpp showed on the models measured "
    "for it (mean 0.00076, Qwen2.5-Coder-0.5B Q4_K_M; p99 0.0105, Qwen2.5-Coder-1.5B Q4_K_M)"
)


def fallback_floor() -> dict[str, Any]:
    return {
        "source": "fallback",
        "kl_mean": FALLBACK_KL_MEAN,
        "kl_p99": FALLBACK_KL_P99,
        "method": FALLBACK_METHOD,
    }


def peer_floor(peer_quality: Mapping[str, Any]) -> dict[str, Any]:
    """The floor from llama.cpp's own measurement (Comparison.summary of it)."""
    return {"source": "llama.cpp", **dict(peer_quality)}


def check(quality: Mapping[str, Any] | None, floor: Mapping[str, Any]) -> str | None:
    """None when the variant's measured quality is within the floor, else why it is not (for the log and the
    manifest). A variant that was not measured is never within it."""
    if not quality or "kl_mean" not in quality or "kl_p99" not in quality:
        return "its KL against the fp32 reference was not measured"
    who = "llama.cpp's on the same GGUF" if floor.get("source") == "llama.cpp" else "the fallback budget"
    over = [
        f"KL {stat} {float(quality[key]):.3g} > {float(floor[key]):.3g}"
        for stat, key in (("mean", "kl_mean"), ("p99", "kl_p99"))
        if float(quality[key]) > float(floor[key])
    ]
    if not over:
        return None
    return f"{', '.join(over)} ({who})"
