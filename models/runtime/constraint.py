"""Constrained decoding: the set of tokens a grammar allows next, as a mask the sampler applies.

Built on llguidance (the library onnxruntime-genai uses; bench/experiments/constrain_libs.py and
docs/structured.md say why not xgrammar). Its grammars come from a JSON schema, a Lark grammar (which can
embed JSON schemas with `%json {...}`: tool calls use that) or a llama.cpp GBNF grammar. The grammar text is
what travels in GenerationParams; the tokenizer side is bound when a reply starts.

- `ConstraintVocabulary`: llguidance's view of one Tokenizer (token bytes, special and end ids). Building it
  costs about a second for SmolLM2's 49k vocabulary and several for Gemma 3's 262k, so it is built once per
  tokenizer, on first use, and kept.
- `check_grammar` compiles a grammar without a tokenizer: what a request asks for that llguidance does not
  implement becomes InvalidParameter naming it, before the job is queued.
- `Constraint`: one reply's parser state. It advances only on emitted tokens, so a variant switch (a
  re-prefill of the same tokens) leaves it as it is; `rebind` rebuilds it over another tokenizer from the
  bytes emitted so far (a model switch mid-reply). End-of-generation ids are allowed exactly when the
  grammar accepts; once the grammar is complete they are the only ones.
- The next mask can be computed on a helper thread while the model runs its forward pass (llguidance and
  onnxruntime both release the GIL): `prefetch()` starts it, `allowed()` waits for it.

JSON is generated in one canonical layout, `{"a": 1, "b": [2, 3]}` (Python's json.dumps separators, no
other whitespace): a small model left free to choose whitespace can pad a reply with newlines until
max_tokens runs out.
"""

from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance as llg
import numpy as np

from models.errors import InvalidParameter
from models.runtime.tokenizer import Tokenizer

# Separators as Python's json.dumps writes them, and no free whitespace (see the module doc).
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# A grammar that compiles this much work is refused rather than left to stall the worker.
LIMITS = llg.LLParserLimits(verbose_errors=False)


class ConstraintVocabulary:
    """llguidance's tokenizer for one simmer Tokenizer: every id's raw bytes (special tokens marked with
    llguidance's 0xFF prefix, so grammar text never matches them), the end-of-generation ids, and the
    tokenizer's own encoder for re-tokenizing text (`rebind`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_ids = sorted(tokenizer.eos_ids)
        self.llg = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tokenizer)), eos_token=self.eos_ids)
        self.words = (self.vocab_size + 31) // 32

    def spell(self, data: bytes) -> list[int]:
        """Ids whose bytes are exactly `data`: the tokenizer's own encoding when it gives those bytes, else
        (an encoder that adds a prefix space, SentencePiece's add_space_prefix) the longest-match spelling
        over the vocabulary, with single-byte tokens for an unfinished UTF-8 character at the end."""
        ids = self.llg.tokenize_bytes(data)
        if self.llg.decode_bytes(ids) == data:
            return ids
        cut = len(data)
        while cut > 0:
            try:
                text = data[:cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                cut -= 1
        else:
            text = ""
        ids = list(self.llg.greedy_tokenize(text)) if text else []
        if cut < len(data):
            single = {
                self.tokenizer.token_bytes(i): i
                for i in range(self.vocab_size)
                if i not in self.tokenizer.special_ids
            }
            ids += [single[bytes([b])] for b in data[cut:]]
        return ids

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ConstraintVocabulary:
        with _VOCAB_LOCK:
            vocab = _VOCABS.get(tokenizer)
            if vocab is None:
                vocab = _VOCABS[tokenizer] = cls(tokenizer)
            return vocab


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, ConstraintVocabulary] = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


class _Wrapped:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(self, tok: Tokenizer) -> None:
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(tok.special_ids)
        specials = tok.special_ids
        self.tokens = [
            (b"\xff" if i in specials else b"") + tok.token_bytes(i) for i in range(tok.vocab_size)
        ]
        self._tok = tok

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False, parse_special=False)


# ---- grammars ---------------------------------------------------------------------------------------


def _with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    # llguidance reads its options from "x-guidance" in the schema (also inside Lark's %json); the
    # caller's own x-guidance keys are not honoured: the layout is simmer's choice.
    return {**schema, "x-guidance": JSON_LAYOUT}


def json_schema_grammar(schema: dict[str, Any] | None, param: str = "response_format") -> str:
    """The grammar of JSON text valid against `schema` (None: any JSON object, OpenAI's json_object).
    Raises InvalidParameter(param) for a schema llguidance cannot even read (an integer beyond 64 bits)."""
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(_with_layout(schema or ANY_JSON_OBJECT)))
    except ValueError as e:
        raise InvalidParameter(f"{param}: the schema cannot be read: {_short(str(e))}", param=param) from e


def lark_grammar(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def gbnf_grammar(gbnf: str, param: str = "grammar") -> str:
    """A llama.cpp GBNF grammar (its `grammar` field)."""
    try:
        return llg.grammar_from("gbnf", gbnf)
    except ValueError as e:
        raise InvalidParameter(f"{param}: {e}", param=param) from e


def json_lark(schema: dict[str, Any]) -> str:
    """`%json {...}`: a JSON schema inside a Lark grammar, in simmer's JSON layout."""
    return "%json " + json.dumps(_with_layout(schema), ensure_ascii=False)


def check_grammar(grammar: str, param: str) -> None:
    """Compile `grammar` without a tokenizer; raise InvalidParameter(param) with llguidance's reason
    (an unimplemented JSON-schema keyword, a bad $ref, a Lark syntax error, ...). Drops the GIL."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=LIMITS)
    if is_error:
        reason = messages[0] if messages else "the grammar does not compile"
        raise InvalidParameter(f"{param}: unsupported or invalid: {_short(reason)}", param=param)


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


# ---- the per-reply state ----------------------------------------------------------------------------

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="simmer-mask")
        return _POOL


class Constraint:
    """One reply's grammar state over one vocabulary. Not thread-safe by itself: the one caller (the
    engine's generation loop) calls prefetch() after advance() and allowed() before the next advance()."""

    def __init__(self, grammar: str, vocab: ConstraintVocabulary, *, prefetch: bool = True) -> None:
        self.grammar = grammar
        self.vocab = vocab
        self.use_prefetch = prefetch
        self.emitted = bytearray()  # the bytes of every token advanced over (for rebind)
        self._matcher = llg.LLMatcher(vocab.llg, grammar, log_level=0, limits=LIMITS)
        if self._matcher.is_error():
            raise InvalidParameter(f"grammar: {_short(self._matcher.get_error())}", param="grammar")
        self._bits = np.zeros(vocab.words, dtype=np.int32)
        self._pending: Future | None = None
        self._fresh = False  # _bits holds the mask for the current state

    # -- masks --
    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def prefetch(self) -> None:
        """Start computing the next mask on the helper thread (no-op when prefetch is off)."""
        if self.use_prefetch and self._pending is None and not self._fresh:
            self._pending = _pool().submit(self._compute)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            self._fresh = True
        elif not self._fresh:
            self._compute()
            self._fresh = True

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens that keep the output inside the grammar (the
        end-of-generation ids exactly when the grammar accepts)."""
        self._wait()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.vocab.vocab_size].view(np.bool_)

    # -- state --
    def advance(self, token: int) -> None:
        """Move past an emitted token (which allowed() permitted)."""
        self._wait()
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constraint rejected token {token}: {self._matcher.get_error()}")
        if token not in self.vocab.eos_ids:
            self.emitted += self.vocab.tokenizer.token_bytes(token)
        self._fresh = False

    @property
    def accepting(self) -> bool:
        """The output so far is complete (ending here is valid)."""
        self._wait()
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but an end-of-generation token can follow."""
        self._wait()
        return self._matcher.is_stopped()

    def rebind(self, vocab: ConstraintVocabulary) -> Constraint:
        """The same grammar over another tokenizer, advanced over the bytes emitted so far (re-tokenized
        by the new tokenizer): the constraint a reply continues with after a model switch."""
        self._wait()
        other = Constraint(self.grammar, vocab, prefetch=self.use_prefetch)
        if self.emitted:
            ids = vocab.spell(bytes(self.emitted))
            if not other._matcher.consume_tokens(ids):
                raise RuntimeError(
                    f"rebind: the new tokenizer's ids were refused: {other._matcher.get_error()}"
                )
            other.emitted = bytearray(self.emitted)
        return other

    def close(self) -> None:
        """Wait for a mask still being computed (the matcher must not be freed under it)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
