"""A BERT GGUF's WordPiece vocabulary as the tokenizer.json a sentence-transformers folder carries.

llama.cpp's converter respells the vocabulary for its own WordPiece tokenizer (llama-vocab.cpp, "wpm"),
which looks each word up with a leading U+2581 ("phantom space"): a word-initial piece gains that U+2581,
a `##` continuation loses its `##`, a control token ([CLS], [SEP], ...) stays as it is. Reading it back
undoes exactly that, so the ids are the checkpoint's. What llama.cpp does around the lookup is what
Hugging Face's BERT pipeline does, and is written as that: its BertNormalizer (lowercasing and accent
stripping, both on unless the GGUF's `tokenizer.ggml.normalizer.*` keys say otherwise, as llama.cpp reads
them), its BERT pre-tokenizer (whitespace, punctuation, CJK characters), a word with no spelling in the
vocabulary as one [UNK], and [CLS] ... [SEP] around every text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from models.errors import InvalidModelFile, UnsupportedModel
from models.runtime.spm import SPACE, TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED

CONTINUATION = "##"
# llama.cpp spells the separator key so (gguf-py's Keys.Tokenizer.SEP_ID)
_SEP_KEYS = ("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id")
_CLS_KEYS = ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id")


def checkpoint_piece(token: str, token_type: int) -> str:
    """A GGUF vocabulary entry as the checkpoint's vocab.txt spells it (the inverse of the converter's
    phantom-space spelling)."""
    if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN):
        return token
    if token.startswith(SPACE):
        return token[len(SPACE) :]
    return CONTINUATION + token


def _special_id(meta: Mapping[str, Any], keys: Sequence[str], default: int, size: int, what: str) -> int:
    """The first key the file has, else llama.cpp's default for a `bert` vocabulary (bert-base's ids)."""
    value = next((meta[k] for k in keys if k in meta), default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise InvalidModelFile(f"the GGUF's {what} token {value!r} is outside its {size} tokens ({keys[0]})")
    return value


def wordpiece_tokenizer(tokens: Sequence[str], types: Sequence[int], meta: Mapping[str, Any]) -> dict:
    """tokenizer.json's contents for the GGUF's `tokenizer.ggml.tokens` / `token_type` and its special ids
    and normalizer flags (`meta`)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "bert":
        raise UnsupportedModel(f"tokenizer {model!r}: a BERT encoder's GGUF has a `bert` one (WordPiece)")
    if len(tokens) != len(types):
        raise InvalidModelFile(f"{len(tokens)} tokens but {len(types)} token types")
    size = len(tokens)
    unk = _special_id(meta, ("tokenizer.ggml.unknown_token_id",), 100, size, "unknown")
    cls = _special_id(meta, _CLS_KEYS, 101, size, "[CLS]")
    sep = _special_id(meta, _SEP_KEYS, 102, size, "[SEP]")
    vocab: dict[str, int] = {}
    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == TOKEN_UNUSED and i not in (unk, cls, sep):
            continue  # ids the converter padded the vocabulary with: never produced
        piece = checkpoint_piece(token, kind)
        if vocab.setdefault(piece, i) != i:
            raise InvalidModelFile(f"token {i} {token!r} spells {piece!r} as token {vocab[piece]} does")
        # matched in the text before WordPiece, as a folder's added_tokens are
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            special.append(AddedToken(piece, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(piece, normalized=False))
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase))

    tok = tokenizers.Tokenizer(
        models.WordPiece(
            vocab, unk_token=checkpoint_piece(tokens[unk], types[unk]), max_input_chars_per_word=100
        )
    )
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_piece, sep_piece = (
        checkpoint_piece(tokens[cls], types[cls]),
        checkpoint_piece(tokens[sep], types[sep]),
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls_piece}:0 $A:0 {sep_piece}:0",
        pair=f"{cls_piece}:0 $A:0 {sep_piece}:0 $B:1 {sep_piece}:1",
        special_tokens=[(cls_piece, cls), (sep_piece, sep)],
    )
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION)
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return json.loads(tok.to_str())
