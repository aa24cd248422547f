"""The tokenizer side of a model, for llama.cpp's /tokenize, /detokenize and /apply-template.

A loaded model answers with its engine's tokenizer. A model that is not loaded (not yet, or unloaded by
keep_alive) answers with its tokenizer and chat template alone, read from its folder without the weights:
the files and classes its engine reads, so the same ids and the same prompt. The last one read is kept, so
a client that tokenizes often does not read the files each time.

All of this runs on one thread of its own, one request at a time (Runtime.tokenizer_executor): a 1 MB text
becomes a million ids and as many Python objects, and sixteen of them at once on the shared pool held the
event loop for seconds and left the heap hundreds of MB larger for good. After a large request the freed
heap goes back to the OS.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from models.runtime.chat import ChatTemplate
from models.runtime.engine import nominal_variant, release_freed_memory
from models.runtime.genai_config import DecoderIO
from models.runtime.text_side import TextSideMixin, read_tokenizer
from server.serving.catalog import CatalogEntry

# Characters of input (or ids) from which a request's garbage is worth handing back to the OS at once.
LARGE = 64 * 1024


class TextSide(Protocol):
    """What the tokenizer routes use of a model (an Engine has it too)."""

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def chat_text(self, messages: list[dict]) -> str: ...


class ModelText(TextSideMixin):
    """A model's tokenizer and chat template without its weights (the engine's own way of reading them)."""

    def __init__(self, entry: CatalogEntry, chat_template: str | None) -> None:
        assert entry.path is not None
        manifest: dict[str, Any] = dict(entry.manifest)
        variants = manifest.get("variants") or {}
        variant = nominal_variant(manifest) or next(iter(variants), None)
        genai = (variants.get(variant) or {}).get("genai") if variant else None
        folder = Path(entry.path)
        self.model_id = entry.id
        self.tokenizer = read_tokenizer(folder, DecoderIO.from_dict(genai) if genai else None)
        self.template = ChatTemplate.from_tokenizer(self.tokenizer, chat_template)


class Tokenizers:
    """The tokenizer side of models that are not loaded: the last one read, kept."""

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template  # SIMMER_CHAT_TEMPLATE's text, as the engines get it
        self._lock = threading.Lock()
        self._kept: tuple[tuple[str, Path | None], ModelText] | None = None

    def of(self, entry: CatalogEntry) -> ModelText:
        key = (entry.id, entry.path)
        with self._lock:
            if self._kept is not None and self._kept[0] == key:
                return self._kept[1]
        text = ModelText(entry, self.chat_template)
        with self._lock:
            self._kept = (key, text)
        return text


def give_back_if_large(size: int) -> None:
    """After a large request: its objects are gone; hand the heap they used back to the OS."""
    if size >= LARGE:
        release_freed_memory()
