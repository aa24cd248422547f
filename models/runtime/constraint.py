"""Constrained decoding: the set of tokens a grammar allows next, as a mask the sampler applies.

Built on llguidance (the library onnxruntime-genai uses; docs/structured.md has the measurements that
chose it over xgrammar). Its grammars come from a JSON schema, a Lark grammar (which can
embed JSON schemas with `%json {...}`: tool calls use that) or a llama.cpp GBNF grammar. The grammar text is
what travels in GenerationParams; the tokenizer side is bound when a reply starts.

- `ConstraintVocabulary`: llguidance's view of one Tokenizer (token bytes, special and end ids). Building it
  costs about a second for SmolLM2's 49k vocabulary and several for Gemma 3's 262k, so it is built once per
  tokenizer, on first use, and kept.
- `check_grammar` compiles a grammar over a byte-level vocabulary and takes its first step: what a request
  asks for that llguidance does not implement, or a grammar that allows no output at all (a `$ref` that
  only refers to itself), becomes InvalidParameter naming it, before the job is queued.
- Grammars are bounded before llguidance sees them (schema_limits, json_bounds, gbnf) and compiled, and
  their masks computed, on threads with a large stack (grammar_threads, `GRAMMAR_CHECKS` and the mask
  thread): a stack overflow in native code would end the process. A matcher that fails mid-reply (one of
  llguidance's per-step limits) raises ConstraintFailed, an InvalidParameter: a 400 before the reply is
  sent, an error event in a stream.
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

import functools
import json
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import llguidance as llg
import numpy as np

from models.errors import InvalidParameter
from models.runtime.gbnf import gbnf_to_lark
from models.runtime.grammar_threads import StackExecutor
from models.runtime.json_bounds import bound_schema
from models.runtime.schema_limits import check_schema_limits
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
        self._by_bytes: dict[bytes, int] | None = None  # for _longest_match, built on first use
        self._longest = 1

    def __call__(self, text: bytes | str) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tok.encode(
            data.decode("utf-8", errors="replace"), add_special_tokens=False, parse_special=False
        )
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        # An encoder that adds a prefix space (SentencePiece's add_space_prefix) spells "}" as "▁" "}":
        # llguidance would then allow the "▁" its grammar refuses. The bytes exactly, longest token first.
        return self._longest_match(data)

    def _longest_match(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            specials = set(self.special_token_ids)
            self._by_bytes = {t: i for i, t in enumerate(self.tokens) if i not in specials and t}
            self._longest = max(map(len, self._by_bytes), default=1)
        by_bytes = self._by_bytes
        out: list[int] = []
        at = 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = by_bytes.get(data[at : at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:
                return out  # a byte no token spells: as far as it goes
        return out


# ---- grammars ---------------------------------------------------------------------------------------


def _with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    # llguidance reads its options from "x-guidance" in the schema (also inside Lark's %json); the
    # caller's own x-guidance keys are not honoured: the layout is simmer's choice.
    return {**schema, "x-guidance": JSON_LAYOUT}


def json_schema_grammar(schema: dict[str, Any] | None, param: str = "response_format") -> str:
    """The grammar of JSON text valid against `schema` (None: any JSON object, OpenAI's json_object), its
    numbers and strings bounded (json_bounds). Raises InvalidParameter(param) for a schema too large or too
    deep to compile safely (schema_limits) or one llguidance cannot even read (an integer beyond 64 bits)."""
    schema = schema or ANY_JSON_OBJECT
    check_schema_limits(schema, param)
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(_with_layout(bound_schema(schema))))
    except ValueError as e:
        raise InvalidParameter(f"{param}: the schema cannot be read: {_short(str(e))}", param=param) from e


def lark_grammar(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def gbnf_grammar(gbnf: str, param: str = "grammar") -> str:
    """A llama.cpp GBNF grammar (its `grammar` field), bounded and converted in linear time (gbnf.py): a
    64 KB grammar takes a fraction of a second of pure Python, so callers run it off the event loop."""
    lark = gbnf_to_lark(gbnf, param)
    try:
        return llg.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise InvalidParameter(f"{param}: {_short(str(e))}", param=param) from e


def json_lark(schema: dict[str, Any]) -> str:
    """`%json {...}`: a JSON schema inside a Lark grammar, in simmer's JSON layout, its numbers and strings
    bounded (json_bounds). The route checked its limits (`json_schema_grammar`)."""
    return "%json " + json.dumps(_with_layout(bound_schema(schema)), ensure_ascii=False)


class ConstraintFailed(InvalidParameter):
    """The grammar's matcher failed mid-reply: one of llguidance's per-step limits (too many parser items
    in a row, lexer fuel), or a token it refused."""


# Where the route compiles a request's grammars (a large stack; one thread: a burst of requests queues
# here instead of taking every core and the event loop's share of the GIL).
GRAMMAR_CHECKS = StackExecutor("simmer-grammar")


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for compiling a grammar before a model is chosen."""

    eos_token_id = 256
    bos_token_id = None
    special_token_ids = (256,)
    tokens = (*(bytes([b]) for b in range(256)), b"\xff<end>")

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_vocabulary() -> Any:
    return llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))


def check_grammar(grammar: str, param: str) -> None:
    """Compile `grammar` over a byte-level vocabulary and compute its first mask; raise
    InvalidParameter(param) with llguidance's reason (an unimplemented JSON-schema keyword, a bad $ref, a
    Lark syntax error, a grammar that allows no output, ...). Drops the GIL; run it on GRAMMAR_CHECKS."""
    matcher = llg.LLMatcher(_byte_vocabulary(), grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise InvalidParameter(f"{param}: unsupported or invalid: {_reason(matcher)}", param=param)
    for step in range(PROBE_BYTES):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            if step == 0:
                raise InvalidParameter(
                    f"{param}: unsupported or invalid: the grammar allows no output ({_reason(matcher)})",
                    param=param,
                )
            reason = _reason(matcher)
            raise InvalidParameter(f"{param}: too large for the grammar engine: {reason}", param=param)
        byte = _probe_byte(mask)
        if byte is None or matcher.is_stopped():
            return
        matcher.consume_token(byte)


# What check_grammar walks of an output before any reply: the parser's limits show only as a reply is
# generated (1,998 string properties passed the first mask, then failed at the first property name, about
# 3 s into the reply, "Current row has 7991 items; max is 2000"). The walk takes the first structural byte
# allowed at each step, so it opens objects, arrays and strings where a schema's output starts.
PROBE_BYTES = 24
_PREFERRED = b'{["'


def _probe_byte(mask: bytes) -> int | None:
    """The byte the probe walk takes next: a preferred one, else the first printable one that is not a
    space, else any; None when the mask allows no byte (only the end)."""
    allowed = [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]
    for b in _PREFERRED:
        if b in allowed:
            return b
    printable = [b for b in allowed if 0x21 <= b < 0x7F]
    return (printable or allowed or [None])[0]


def _reason(matcher: Any) -> str:
    # llguidance's message, without the parser state it appends ("<non-verbose/>" with LIMITS)
    return _short(matcher.get_error().split("\n<", 1)[0])


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


# ---- the per-reply state ----------------------------------------------------------------------------

# The mask thread: a reply's matcher is built and its masks computed here (a large stack), the next mask
# while the model runs its forward pass.
_MASKS = StackExecutor("simmer-mask")


class Constraint:
    """One reply's grammar state over one vocabulary. Not thread-safe by itself: the one caller (the
    engine's generation loop) calls prefetch() after advance() and allowed() before the next advance()."""

    def __init__(self, grammar: str, vocab: ConstraintVocabulary, *, prefetch: bool = True) -> None:
        self.grammar = grammar
        self.vocab = vocab
        self.use_prefetch = prefetch
        self.emitted = bytearray()  # the bytes of every token advanced over (for rebind)
        self._matcher = _MASKS.run(llg.LLMatcher, vocab.llg, grammar, log_level=0, limits=LIMITS)
        if self._matcher.is_error():
            raise InvalidParameter(f"grammar: {_reason(self._matcher)}", param="grammar")
        self._bits = np.zeros(vocab.words, dtype=np.int32)
        self._pending: Future | None = None
        self._fresh = False  # _bits holds the mask for the current state

    # -- masks --
    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise ConstraintFailed(f"the output grammar cannot go on here: {_reason(self._matcher)}")

    def prefetch(self) -> None:
        """Start computing the next mask on the mask thread (no-op when prefetch is off)."""
        if self.use_prefetch and self._pending is None and not self._fresh:
            self._pending = _MASKS.submit(self._compute)

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
            raise ConstraintFailed(f"the output grammar refused token {token}: {_reason(self._matcher)}")
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
        """Wait for a mask still being computed (the matcher must not be freed under it); a failure of that
        mask is the reply's no longer."""
        if self._pending is not None:
            self._pending.exception()
            self._pending = None
