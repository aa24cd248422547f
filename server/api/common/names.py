"""How model names are written at the edge: Ollama's default tag names the model listed without it, on
every route (`/v1/models/smollm2-135m-instruct:latest` is `smollm2-135m-instruct`)."""

from __future__ import annotations

LATEST = ":latest"  # Ollama's default tag: "smollm2-135m-instruct:latest" names "smollm2-135m-instruct"


def model_id(name: str) -> str:
    """The simmer id a model name stands for: only the default tag is dropped (exact names)."""
    return name.removesuffix(LATEST) if name.endswith(LATEST) else name
