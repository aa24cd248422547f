"""The real engine with its forward pass replaced by a script: a fake through the session seam.

`scripted_engine(folder, reply)` opens a converted folder (a tiny model) as DecoderEngine does, but each
forward pass returns logits that favour the next token of `reply` (encoded by the model's own tokenizer),
then an end-of-generation token. Everything else is the engine's own: the chat template, the grammar and
its masks, the sampler, the detokenizer, the stop matcher, the tool-call reader. So a test can make a
model "write" a given reply, as real models do, and check what reaches the client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from models.runtime.engine import DecoderEngine

FAVOURED = 30.0  # the scripted token's logit; every other is 0


class ScriptedSession:
    """Stands in for DecoderSession.run: the fed ids are remembered (by position, as the KV cache holds
    them), and the next token is the script's after the longest prefix of it that the ids end with (a
    script whose first tokens end the prompt too would be taken as begun: start it with something else)."""

    rows_exact = False  # no speculation on a script

    def __init__(self, script: list[int], vocab: int, eos: int, shape: Any) -> None:
        self.script = script
        self.shape = shape  # the real session's (its KV type is the graph's): caches are sized from it
        self.vocab = vocab
        self.eos = eos
        self.seq: list[int] = []
        self.logits = np.zeros(vocab, np.float32)

    def run(self, ids: np.ndarray, kv: Any, past_len: int, run_options: Any = None) -> np.ndarray:
        self.seq = [*self.seq[:past_len], *(int(i) for i in np.asarray(ids).reshape(-1))]
        done = 0
        for k in range(min(len(self.script), len(self.seq)), 0, -1):
            if self.seq[-k:] == self.script[:k]:
                done = k
                break
        nxt = self.script[done] if done < len(self.script) else self.eos
        self.logits[:] = 0.0
        self.logits[nxt] = FAVOURED
        return self.logits


class ScriptedEngine(DecoderEngine):
    def __init__(self, model_dir: Path, reply: str, **kwargs: Any) -> None:
        manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
        super().__init__(Path(model_dir), manifest, **kwargs)
        eos = min(self.tokenizer.eos_ids)
        script = self.tokenizer.encode(reply, add_special_tokens=False, parse_special=False)
        self.scripted = ScriptedSession(script, self.vocab_size, eos, super().session().shape)

    def session(self) -> Any:
        if not hasattr(self, "scripted"):  # the load check in DecoderEngine.__init__: a real session
            return super().session()
        return self.scripted


def scripted_engine(model_dir: Path, reply: str, **kwargs: Any) -> ScriptedEngine:
    kwargs.setdefault("threads", 1)
    return ScriptedEngine(model_dir, reply, **kwargs)
