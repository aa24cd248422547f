"""The runtime tokenizer, loaded from a converted model folder.

The conversion (models/convert/tokenizer_gguf.py) builds it from a GGUF so that its ids equal
llama.cpp's and saves tokenizer.json plus a Hugging Face style tokenizer_config.json (which also
records what the engine needs: the token kind, the end-of-generation ids, the chat template).
onnxruntime-genai reads those two files. Simmer itself reads a compact file of its own when the converter
wrote one: tokenizer.spm.npz for a SentencePiece vocabulary (spm.py: its tokenizer.json is ~100 MB resident
once loaded), tokenizer.bpe.npz for a byte-level BPE (bpe.py: parsing its tokenizer.json holds the GIL for
a quarter of a second). Folders without one are read back with Hugging Face `tokenizers`.

Two kinds of vocabulary: byte-level BPE (GPT-2's printable stand-ins for bytes) and SentencePiece
(U+2581 for spaces, <0xXX> tokens for raw bytes). `token_bytes` gives the raw bytes of any token, the
way llama.cpp's token_to_piece does, so streamed text never splits a UTF-8 character.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import hashlib
import json
import re
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

import tokenizers

from models.errors import InvalidModelFile
from models.runtime import bpe as bpe_file
from models.runtime.bpe import BytePairEncoding, byte_chars
from models.runtime.spm import TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED, VOCAB_FILE, SentencePiece

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
KIND_BYTE_LEVEL = "byte_level"
KIND_SENTENCEPIECE = "sentencepiece"
KINDS = (KIND_BYTE_LEVEL, KIND_SENTENCEPIECE)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
Span = tuple[int, int]


def tokenizer_key(folder: str | Path) -> str:
    """What says whether two model folders share a vocabulary: the sha256 of their tokenizer.json (the
    vocabulary, merges and added tokens; two sizes of one family have the same file). A folder without
    one gets a key of its own."""
    path = Path(folder) / TOKENIZER_JSON
    try:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return f"unreadable:{Path(folder).resolve()}"


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE uses back to raw bytes."""
    return {c: b for b, c in enumerate(byte_chars())}


def infer_kind(hf: tokenizers.Tokenizer) -> str:
    """The kind of a tokenizer.json made elsewhere (an onnxruntime-genai folder), from its decoder:
    SentencePiece decodes U+2581 and <0xXX> byte tokens (Metaspace or ByteFallback), byte-level BPE maps
    GPT-2's stand-ins back to bytes."""
    decoder = hf.decoder
    state = decoder.__getstate__() if decoder is not None else b""
    if b'"ByteLevel"' not in state and (b'"ByteFallback"' in state or b'"Metaspace"' in state):
        return KIND_SENTENCEPIECE
    return KIND_BYTE_LEVEL


def _overlaps(span: Span, spans: Sequence[Span]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in spans)


class Tokenizer:
    """Encode/decode plus the facts the engine needs: bos/eos ids, end-of-generation ids, token bytes."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer | None,
        *,
        spm: SentencePiece | None = None,
        bpe: BytePairEncoding | None = None,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: Iterable[int] = (),
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        add_space_prefix: bool = False,
        kind: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        if spm is not None:
            kind = KIND_SENTENCEPIECE
        elif bpe is not None:
            kind = KIND_BYTE_LEVEL
        elif hf is None:
            raise ValueError("a Tokenizer needs a tokenizers.Tokenizer or a compact vocabulary")
        else:
            kind = kind or infer_kind(hf)
        if kind not in KINDS:
            raise InvalidModelFile(f"unknown tokenizer kind {kind!r} (known: {', '.join(KINDS)})")
        # With `spm` or `bpe`, encoding and the vocabulary are its own; `hf` (if any) only writes
        # tokenizer.json.
        self.hf = hf
        self.spm = spm
        self.bpe = bpe
        self._compact: SentencePiece | BytePairEncoding | None = spm if spm is not None else bpe
        self.kind = kind
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template or None
        # Every id that ends generation; always contains eos_id.
        self.eos_ids: frozenset[int] = frozenset({*eos_ids, *([eos_id] if eos_id is not None else [])})
        if self._compact is not None:
            self.vocab_size = self._compact.vocab_size
            types = self._compact.types
            self.added_ids: frozenset[int] = frozenset(
                i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
            )
            self.special_ids: frozenset[int] = frozenset(
                i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)
            )
        else:
            assert hf is not None
            self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
            added = hf.get_added_tokens_decoder()
            self.added_ids = frozenset(added)
            self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._bytes_cache: list[bytes | None] = [None] * self.vocab_size
        # encode_special_tokens is a switch on the shared tokenizers object; encodes take turns.
        self._lock = threading.Lock()

    def text_of(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_token(token_id)

    def id_to_token(self, token_id: int) -> str | None:
        if self._compact is not None:
            return self._compact.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        assert self.hf is not None
        return self.hf.id_to_token(token_id)

    def token_to_id(self, text: str) -> int | None:
        if self._compact is not None:
            return self._compact.token_to_id(text)
        assert self.hf is not None
        return self.hf.token_to_id(text)

    # -- files ---------------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, a Hugging Face style tokenizer_config.json (plus our own facts) and the
        compact file of a SentencePiece or byte-level BPE vocabulary."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.hf is not None:
            self.hf.save(str(folder / TOKENIZER_JSON))
        if self._compact is not None:
            self._compact.save(folder)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.text_of(self.bos_id),
            "eos_token": self.text_of(self.eos_id),
            "unk_token": self.text_of(self.unk_id),
            "pad_token": self.text_of(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            # absent when the model has none: it serves completions only (no silent stand-in template)
            "chat_template": self.chat_template,
            # Not Hugging Face keys: what load() needs without the GGUF.
            "tokenizer_kind": self.kind,
            "add_space_prefix": self.add_space_prefix,
            "eos_token_ids": sorted(self.eos_ids),
        }
        # onnxruntime-genai refuses a null where it expects a string: absent keys say "none" instead
        config = {k: v for k, v in config.items() if v is not None}
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        try:
            config = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise InvalidModelFile(f"cannot load the tokenizer from {folder}: {e}") from e
        hf, spm, bpe = None, None, None
        if (folder / VOCAB_FILE).is_file():  # converter 9 on: tokenizer.json is not read at all
            prefix = bool(config.get("add_space_prefix"))
            spm = SentencePiece.load(folder, add_space_prefix=prefix, unk_token=config.get("unk_token"))
        elif (folder / bpe_file.VOCAB_FILE).is_file():  # converter 14 on: nor here
            bpe = BytePairEncoding.load(folder)
        else:
            try:
                hf = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_JSON))
            except Exception as e:  # tokenizers raises a plain Exception on bad JSON
                raise InvalidModelFile(f"cannot load the tokenizer from {folder}: {e}") from e
        # Parsing a big tokenizer.json leaves its transient heap with glibc: Gemma 3's 33 MB file holds
        # ~100 MB loaded but ~350 MB of RSS until the freed pages go back to the OS.
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").malloc_trim(0)

        own = spm if spm is not None else bpe

        def tid(key: str) -> int | None:
            t = config.get(key)
            if t is None:
                return None
            return own.token_to_id(t) if own is not None else hf.token_to_id(t) if hf is not None else None

        return cls(
            hf,
            spm=spm,
            bpe=bpe,
            bos_id=tid("bos_token"),
            eos_id=tid("eos_token"),
            eos_ids=config.get("eos_token_ids") or (),
            unk_id=tid("unk_token"),
            pad_id=tid("pad_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            add_eos=bool(config.get("add_eos_token", False)),
            add_space_prefix=bool(config.get("add_space_prefix", False)),
            kind=config.get("tokenizer_kind"),  # older folders: told by the decoder (byte-level BPE)
            chat_template=config.get("chat_template"),
        )

    # -- text <-> ids --------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        parse_special: bool = True,
        literal_spans: Sequence[Span] = (),
    ) -> list[int]:
        """Ids for `text`, as llama.cpp's tokenize(text, add_special, parse_special) gives them.

        `add_special_tokens` adds BOS/EOS when the model asks for them (pass False for a rendered chat
        template, which writes its own). With `parse_special`, the texts of control tokens such as
        <|im_start|> become those tokens; without, they are ordinary text. `literal_spans` keeps
        parsing them everywhere except inside these (start, end) character ranges, which hold text
        from an untrusted source (chat message content)."""
        if self._compact is not None:
            ids = self._compact.encode(text, parse_special=parse_special, literal_spans=literal_spans)
            return self._add_specials(ids) if add_special_tokens else ids
        assert self.hf is not None
        with self._lock:
            if not parse_special:
                return self._encode_text(text, add_special_tokens)
            enc = self._hf_encode(text, add_special_tokens)
            if not literal_spans:
                return enc.ids
            # Specials the plain encode found inside a literal span are text: split only at the others.
            found = [(i, span) for i, span in zip(enc.ids, enc.offsets, strict=True) if i in self.special_ids]
            if not any(_overlaps(span, literal_spans) for _, span in found):
                return enc.ids
            ids: list[int] = []
            pos = 0
            for token_id, (start, end) in found:
                if start == end or _overlaps((start, end), literal_spans):
                    continue  # an empty span is a BOS/EOS the post-processor added
                ids += self._encode_text(text[pos:start], False)
                ids.append(token_id)
                pos = end
            ids += self._encode_text(text[pos:], False)
        return self._add_specials(ids) if add_special_tokens else ids

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """Special-token texts as plain text (user-defined tokens are still matched, as in llama.cpp)."""
        if not text:
            return self._add_specials([]) if add_special_tokens else []
        assert self.hf is not None
        self.hf.encode_special_tokens = True
        try:
            return self._hf_encode(text, add_special_tokens).ids
        finally:
            self.hf.encode_special_tokens = False

    def _hf_encode(self, text: str, add_special_tokens: bool) -> tokenizers.Encoding:
        """The library's encode, as its batch of one: that lets the GIL go while it works (the single encode
        holds it: 3 s for 1 MB of CJK, with the event loop and every other thread stopped); the same ids
        and offsets."""
        assert self.hf is not None
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _add_specials(self, ids: list[int]) -> list[int]:
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        tail = [self.eos_id] if self.add_eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`: the concatenated token bytes (what the streaming detokenizer gives), minus
        the one space a SentencePiece vocabulary with add_space_prefix put in front, so that
        decode(encode(text)) == text."""
        data = b"".join(
            self.token_bytes(i) for i in ids if not (skip_special_tokens and i in self.special_ids)
        )
        text = data.decode("utf-8", errors="replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (one token may hold part of a UTF-8 character), as llama.cpp's
        token_to_piece renders it: added tokens (control, user-defined) are their own text; byte-level
        tokens map each character back through GPT-2's byte table; SentencePiece tokens turn U+2581 into
        a space and <0xXX> into that byte."""
        cached = self._bytes_cache[token_id] if 0 <= token_id < self.vocab_size else None
        if cached is not None:
            return cached
        piece = self.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        if token_id in self.added_ids:
            out = piece.encode("utf-8")
        elif self.kind == KIND_SENTENCEPIECE:
            byte = _BYTE_TOKEN.fullmatch(piece)
            out = bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
        else:
            table = byte_decoder()
            try:
                out = bytes(table[c] for c in piece)
            except KeyError:  # not a byte-level piece; llama.cpp would show it as [UNK_BYTE_...]
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
    decode(skip_special_tokens=True)). The concatenated deltas plus flush() equal tokenizer.decode(ids),
    except that a reply keeps the leading space a SentencePiece token such as "▁Paris" stands for (the
    reply continues the prompt's text, as llama.cpp streams it).
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
