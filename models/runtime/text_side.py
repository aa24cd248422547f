"""A model's text side: its tokenizer and chat template, read from its folder as the engine reads them, and
what llama.cpp's /tokenize, /detokenize and /apply-template ask of them. The engine has one; a model that is
not loaded answers with one alone, read without the weights (server/serving/tokenizers.py)."""

from __future__ import annotations

from pathlib import Path

from models.errors import ModelNotChat
from models.runtime.chat import ChatTemplate
from models.runtime.genai_config import DecoderIO, load_tokenizer
from models.runtime.tokenizer import Tokenizer


def read_tokenizer(folder: Path, io: DecoderIO | None) -> Tokenizer:
    """A folder installed as is (onnxruntime-genai layout, `io` given) keeps its tokenizer files; ours
    has the tokenizer the converter wrote."""
    return load_tokenizer(folder, io) if io is not None else Tokenizer.load(folder)


class TextSideMixin:
    """tokenize, token_bytes and chat_text over `tokenizer` and `template` (None: a base model)."""

    model_id: str
    tokenizer: Tokenizer
    template: ChatTemplate | None

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.tokenizer.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary ({self.tokenizer.vocab_size})")
        return self.tokenizer.token_bytes(token_id)

    def chat_text(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ModelNotChat.for_model(self.model_id)
        return self.template.render(messages)
