"""Run a converted sentence encoder (models/convert/encoder_convert.py): texts -> token ids -> one padded
batch per `embed` call -> unit vectors.

`embed` is one forward pass over the rows it is given, padded to the longest; whoever calls it bounds the
rows (the server splits a request into batches of at most `MAX_BATCH`, so the worker can run other work
between them). Token ids are checked here, where the vocabulary and the context are known: an id outside
the vocabulary or a row over the context is refused with the row's index, never run.

It opens the variant it is given, else the one the folder's manifest names as nominal (f32 for every pull:
models/convert/encoder_quality.py), else `f32` (a folder converted without the store has no manifest).
`opened_variant` is the server's rule: SIMMER_VARIANT where the folder has it, else the nominal one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tokenizers

from models.convert.encoder_config import ENCODER_CONFIG, F32, GRAPHS, OUTPUT, TOKENIZER, EncoderConfig
from models.errors import ContextLengthExceeded, InvalidModelFile, InvalidParameter
from models.runtime.session import session_options

# Rows per forward pass. Attention is quadratic in the longest row and the batch is padded to it: 32 rows
# of a 256-token context is ~100 MB of scores for a 12-head model, a bound a phone can carry.
MAX_BATCH = 32
MANIFEST = "manifest.json"  # the store's (models/store/manifest.py), named here to keep the store unimported


def is_encoder_folder(folder: Path) -> bool:
    return (Path(folder) / ENCODER_CONFIG).is_file()


def _manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def nominal_variant(folder: Path) -> str:
    """The manifest's default_variant, or f32 where there is no manifest (or it names no encoder variant)."""
    chosen = _manifest(folder).get("default_variant")
    return chosen if chosen in GRAPHS else F32


def installed_variants(folder: Path) -> list[str]:
    """The variants the manifest lists; without a manifest, those whose graph is in the folder."""
    listed = _manifest(folder).get("variants")
    if isinstance(listed, dict):
        return [v for v in GRAPHS if v in listed]
    return [v for v, graph in GRAPHS.items() if (Path(folder) / graph).is_file()]


def opened_variant(folder: Path, preferred: str | None) -> str:
    """`preferred` where the folder has it (SIMMER_VARIANT names a variant for every model that has one), else
    the nominal one."""
    return preferred if preferred in installed_variants(folder) else nominal_variant(folder)


class Embedder:
    def __init__(self, folder: Path, threads: int = 1, variant: str | None = None) -> None:
        folder = Path(folder)
        self.variant = variant or nominal_variant(folder)
        if self.variant not in installed_variants(folder):
            raise InvalidParameter(
                f"{folder.name} has no encoder variant {self.variant!r} (installed: "
                f"{', '.join(installed_variants(folder)) or 'none'})",
                param="variant",
            )
        try:
            self.config = EncoderConfig.from_json(
                json.loads((folder / ENCODER_CONFIG).read_text(encoding="utf-8"))
            )
            self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER))
        except (OSError, ValueError) as err:
            raise InvalidModelFile(f"{folder} is not an encoder folder: {err}") from err
        self.graph = GRAPHS[self.variant]
        self._session = ort.InferenceSession(
            str(folder / self.graph),
            sess_options=session_options(threads),
            providers=["CPUExecutionProvider"],
        )

    @property
    def dimensions(self) -> int:
        return self.config.hidden

    @property
    def context(self) -> int:
        return self.config.context

    def tokenize(self, texts: Sequence[str], fit: bool = False) -> list[list[int]]:
        """Each text as the model reads it ([CLS] ... [SEP]). Without `fit` nothing is cut (check refuses a
        row over the context); with it such a row keeps its first tokens and its closing [SEP], as
        sentence-transformers cuts a text to the model's length (the model was trained on rows that end in
        [SEP])."""
        rows = [list(enc.ids) for enc in self._tokenizer.encode_batch(list(texts))]
        if fit:
            rows = [r if len(r) <= self.context else r[: self.context - 1] + r[-1:] for r in rows]
        return rows

    def check(self, rows: Sequence[Sequence[int]], param: str = "input", first: int = 0) -> None:
        """Refuse what the graph must not run: no rows, an empty row, an id outside the vocabulary, a row
        longer than the context. `first`: the first row's index in the request, which a refusal names."""
        if not rows:
            raise InvalidParameter("nothing to embed", param=param)
        for i, row in enumerate(rows, start=first):
            if not row:
                raise InvalidParameter(f"input {i} is empty", param=param)
            if len(row) > self.context:
                raise ContextLengthExceeded(
                    f"input {i} has {len(row)} tokens; this model's context is {self.context}",
                    param=param,
                    context_length=self.context,
                    prompt_tokens=len(row),
                )
            low, high = min(row), max(row)
            if low < 0 or high >= self.config.vocab:
                bad = low if low < 0 else high
                raise InvalidParameter(
                    f"input {i} has token id {bad}, outside this model's vocabulary"
                    f" (0..{self.config.vocab - 1})",
                    param=param,
                )

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(rows), dimensions] float32: one forward pass, rows padded to the longest."""
        self.check(rows)
        if len(rows) > MAX_BATCH:
            raise InvalidParameter(f"{len(rows)} rows in one pass; at most {MAX_BATCH}", param="input")
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.config.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        (out,) = self._session.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})
        return np.asarray(out, dtype=np.float32)
