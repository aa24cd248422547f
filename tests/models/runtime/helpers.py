"""Runtime tests' helpers: greedy decoding through onnxruntime-genai and through simmer's engine on the
same folder (the two must agree), and the JSON schema several structured-output tests constrain to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime_genai as og  # a dev dependency: a missing one must fail, not skip

from models.protocol import Prompt
from models.runtime.engine import load_engine
from models.types import GenerationParams, SamplingParams


def og_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids and the logits onnxruntime-genai chose each of them from."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    ids, logits = [], []
    while not gen.is_done():
        logits.append(np.array(gen.get_logits()).reshape(-1))
        gen.generate_next_token()
        ids.append(int(gen.get_next_tokens()[0]))
    return ids, logits


def ours_greedy(folder: Path, prompt: list[int], new_tokens: int, **kw) -> list[int]:
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    engine = load_engine(folder, variant=Path(decoder).stem, threads=1, **kw)
    params = GenerationParams(
        sampling=SamplingParams(temperature=0.0), max_tokens=new_tokens, ignore_eos=True
    )
    return [e.token_id for e in engine.generate(Prompt(list(prompt)), params) if hasattr(e, "token_id")]


def assert_genai_runs_alike(folder: Path) -> None:
    """onnxruntime-genai, reading our genai_config.json, decodes the q4-a8 graph to our greedy ids."""
    cfg = json.loads((folder / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["filename"] == "q4-a8.onnx"
    model = og.Model(str(folder))
    for prompt in ([1, 5, 17, 40, 33, 9], [2, 3]):
        ids, _ = og_greedy(model, list(prompt), 6)
        assert ids == ours_greedy(folder, prompt, 6, context_length=64), prompt


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
