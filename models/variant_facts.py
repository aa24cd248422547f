"""What users are shown of each installed variant (`simmer list`, /v1/models): its quality as measured at
pull time against the fp32 reference of the same GGUF (KL mean and p99, top-1 agreement), its measured speed
on this machine, the floor a re-encoded variant had to meet, and the variants refused for missing it. An
embedding model's int8 variant is measured as a cosine to the f32 one and in sentences per CPU-second
(models/convert/encoder_quality.py): those keys are there only for the variants that have them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _section(entry: Any, key: str) -> Mapping[str, Any]:
    value = entry.get(key) if isinstance(entry, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def variant_facts(manifest: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """{variant: {kl_mean, kl_p99, top1_agreement, decode_tok_s, tokens_per_cpu_s}}; None where a manifest
    (an older converter's, or an onnxruntime-genai folder's) has no measurement."""
    out: dict[str, dict[str, float | None]] = {}
    for name, entry in (manifest.get("variants") or {}).items():
        quality, speed = _section(entry, "quality"), _section(entry, "speed")
        cpu = _number(speed.get("cpu_s_per_token"))
        out[name] = {
            "kl_mean": _number(quality.get("kl_mean")),
            "kl_p99": _number(quality.get("kl_p99")),
            "top1_agreement": _number(quality.get("top1_agreement")),
            "decode_tok_s": _number(speed.get("decode_tok_s")),
            "tokens_per_cpu_s": round(1.0 / cpu, 1) if cpu else None,
        }
        for section, key in (
            (quality, "min_cosine"),
            (quality, "mean_cosine"),
            (speed, "sentences_per_cpu_s"),
        ):
            if key in section:
                out[name][key] = _number(section.get(key))
    return out


def floor_facts(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The quality floor the re-encoded variants were held to ({source, kl_mean, kl_p99}; an embedding
    model's: {source, min_cosine}), if measured."""
    floor = manifest.get("quality_floor")
    if not isinstance(floor, Mapping):
        return None
    if "min_cosine" in floor:
        return {"source": floor.get("source"), "min_cosine": floor.get("min_cosine")}
    return {"source": floor.get("source"), "kl_mean": floor.get("kl_mean"), "kl_p99": floor.get("kl_p99")}


def refused_variants(manifest: Mapping[str, Any]) -> dict[str, str]:
    refused = manifest.get("refused_variants")
    return {str(k): str(v) for k, v in refused.items()} if isinstance(refused, Mapping) else {}


def describe(name: str, facts: Mapping[str, float | None]) -> str:
    """One line: `fast  KL 0.0012 (p99 0.0081)  top-1 97.3%  41.2 tok/s  22.5 tok/CPU-s`."""
    parts = [name]
    if facts.get("kl_mean") is not None:
        parts.append(f"KL {facts['kl_mean']:.2g} (p99 {facts.get('kl_p99') or 0:.2g})")
    if facts.get("min_cosine") is not None:
        parts.append(f"min cosine {facts['min_cosine']:.5f}")
    if facts.get("top1_agreement") is not None:
        parts.append(f"top-1 {100 * (facts['top1_agreement'] or 0):.1f}%")
    if facts.get("decode_tok_s") is not None:
        parts.append(f"{facts['decode_tok_s']:.1f} tok/s")
    if facts.get("tokens_per_cpu_s") is not None:
        parts.append(f"{facts['tokens_per_cpu_s']:.1f} tok/CPU-s")
    if facts.get("sentences_per_cpu_s") is not None:
        parts.append(f"{facts['sentences_per_cpu_s']:.1f} sentences/CPU-s")
    if len(parts) == 1:
        parts.append("not measured")
    return "  ".join(parts)
