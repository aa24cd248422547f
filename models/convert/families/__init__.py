"""Architecture families, one module each, keyed by a GGUF's `general.architecture`: the decoders here
(FAMILIES); the sentence encoders' in bert.py (ENCODER_FAMILIES), which the GGUF converter hands to the
encoder converter before any of these is looked up."""

from __future__ import annotations

from models.convert.families.base import Family, ModelConfig, RopeKind
from models.convert.families.gemma3 import GEMMA3
from models.convert.families.llama import LLAMA
from models.convert.families.qwen2 import QWEN2
from models.convert.families.qwen3 import QWEN3
from models.errors import UnsupportedArchitecture

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, GEMMA3)}


def family_for(architecture: object, source: str = "the model") -> Family:
    family = FAMILIES.get(architecture) if isinstance(architecture, str) else None
    if family is None:
        raise UnsupportedArchitecture(
            f"{source}: architecture {architecture!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return family


__all__ = ["FAMILIES", "Family", "ModelConfig", "RopeKind", "family_for"]
