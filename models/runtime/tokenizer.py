"""The tokenizer, rebuilt from a GGUF's vocabulary with the Hugging Face `tokenizers` library.

Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is supported, with the pre-tokenizers whose
regexes we reproduce exactly (`smollm`, `default`/`gpt2`). Anything else raises UnsupportedModel
rather than tokenizing silently differently from llama.cpp.

`metadata_from_gguf(path)` reads the keys we need into a plain dict; `Tokenizer.from_metadata(meta)`
builds from such a dict, so tests need no file. `Tokenizer.save(folder)` writes tokenizer.json and
tokenizer_config.json next to the ONNX model and `Tokenizer.load(folder)` reads them back.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from models.errors import InvalidModelFile, UnsupportedModel

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template",
)

# llama.cpp also ends generation on control tokens with these exact texts (llama-vocab.cpp, the
# "EOG" list), whatever the GGUF's eos id says: an instruct model that emits <|endoftext|> is done.
EOG_TOKEN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)

_BYTE_LEVEL_PRE = {"default", "gpt2", "smollm"}


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE uses back to raw bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def metadata_from_gguf(path: str | Path) -> dict[str, Any]:
    """Read the tokenizer keys of a GGUF file as plain Python values (string arrays decoded)."""
    import gguf  # heavy import, only needed when reading a GGUF

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise InvalidModelFile(f"cannot read GGUF metadata from {path}: {e}") from e
    return metadata_from_reader(reader)


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    """The tokenizer keys from an already opened gguf.GGUFReader (parsing a GGUF takes ~2 s)."""
    meta: dict[str, Any] = {}
    for key in GGUF_TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is not None:
            meta[key] = field.contents()
    return meta


def build_hf_tokenizer(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that reproduces llama.cpp's ids for this GGUF vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModel(
            f"tokenizer model {model!r} is not supported: simmer handles byte-level BPE ('gpt2') only"
        )
    # llama.cpp treats a missing `pre` as "default" (with a warning); so do we.
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in _BYTE_LEVEL_PRE:
        raise UnsupportedModel(
            f"tokenizer pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_BYTE_LEVEL_PRE))})"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise InvalidModelFile(f"tokenizer has {len(tokens)} tokens but {len(types)} token types")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidModelFile("tokenizer vocabulary has duplicate tokens")
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        parts = m.split(" ")
        if len(parts) != 2:
            raise InvalidModelFile(f"malformed BPE merge {m!r}")
        merges.append((parts[0], parts[1]))

    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's tokenizer splits every digit into its own token before the GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    # Control tokens are matched whole in the input and skipped when decoding. User-defined tokens are
    # matched whole too but stay in decoded text, as llama.cpp renders them.
    added = []
    for text, ttype in zip(tokens, types, strict=True):
        if ttype == TOKEN_CONTROL:
            added.append(AddedToken(text, special=True, normalized=False))
        elif ttype == TOKEN_USER_DEFINED:
            added.append(AddedToken(text, special=False, normalized=False))
    if added:
        # The tokens are already in the vocabulary, so add_tokens keeps their ids.
        tok.add_tokens(added)

    if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None:
        bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    return tok


def _eog_ids(meta: dict[str, Any], tokens: Sequence[str], types: Sequence[int]) -> set[int]:
    ids = {
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(k) is not None
    }
    ids.update(i for i, t in enumerate(tokens) if types[i] == TOKEN_CONTROL and t in EOG_TOKEN_TEXTS)
    return ids


class Tokenizer:
    """Encode/decode plus the facts the engine needs: bos/eos ids, end-of-generation ids, token bytes."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: Iterable[int] = (),
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        # Every id that ends generation; always contains eos_id.
        self.eos_ids: frozenset[int] = frozenset({*eos_ids, *([eos_id] if eos_id is not None else [])})
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        decoded = hf.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in decoded.items() if t.special)
        self._bytes_cache: list[bytes | None] = [None] * self.vocab_size

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        hf = build_hf_tokenizer(meta)
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)

        def opt(key: str) -> int | None:
            v = meta.get(key)
            return None if v is None else int(v)

        return cls(
            hf,
            bos_id=opt("tokenizer.ggml.bos_token_id"),
            eos_id=opt("tokenizer.ggml.eos_token_id"),
            eos_ids=_eog_ids(meta, tokens, types),
            unk_id=opt("tokenizer.ggml.unknown_token_id"),
            pad_id=opt("tokenizer.ggml.padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_metadata(metadata_from_gguf(path))

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and a Hugging Face style tokenizer_config.json (plus our eos ids)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(folder / TOKENIZER_JSON))

        def text(i: int | None) -> str | None:
            return None if i is None else self.hf.id_to_token(i)

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos_id),
            "eos_token": text(self.eos_id),
            "unk_token": text(self.unk_id),
            "pad_token": text(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
            # Not a Hugging Face key: the full end-of-generation set, so load() needs no GGUF.
            "eos_token_ids": sorted(self.eos_ids),
        }
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        try:
            hf = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_JSON))
            config = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise InvalidModelFile(f"cannot load the tokenizer from {folder}: {e}") from e

        def tid(key: str) -> int | None:
            t = config.get(key)
            return None if t is None else hf.token_to_id(t)

        eos_id = tid("eos_token")
        return cls(
            hf,
            bos_id=tid("bos_token"),
            eos_id=eos_id,
            eos_ids=config.get("eos_token_ids") or (),
            unk_id=tid("unk_token"),
            pad_id=tid("pad_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=config.get("chat_template"),
        )

    # -- text <-> ids --------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`. Special-token texts such as <|im_start|> are parsed as those tokens.
        `add_special_tokens` adds BOS when the model asks for it (add_bos_token); pass False for a
        rendered chat template, which carries its own BOS if it wants one (as Hugging Face does)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (one token may hold part of a UTF-8 character).
        Mirrors the ByteLevel decoder: characters map through GPT-2's byte table, and a token
        containing any character outside it (control tokens like <|im_end|> are all ASCII and map to
        themselves) is taken as its UTF-8 text."""
        cached = self._bytes_cache[token_id]
        if cached is not None:
            return cached
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        table = byte_decoder()
        try:
            out = bytes(table[c] for c in piece)
        except KeyError:
            out = piece.encode("utf-8")
        self._bytes_cache[token_id] = out
        return out

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs; a partial UTF-8 character shows as U+FFFD (bytes say the rest)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Bytes of an incomplete character are held back until the rest arrives; invalid bytes become
    U+FFFD exactly as a full decode would make them. Special tokens are skipped (like
    decode(skip_special_tokens=True)). The concatenated deltas plus flush() equal tokenizer.decode(ids).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._tok.is_special(token_id):
            return ""
        return self._decoder.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Any held-back bytes (an unfinished character becomes U+FFFD); the detokenizer is reset."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out
