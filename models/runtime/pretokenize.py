"""Byte-level BPE pre-tokenization without `tokenizers`: llama.cpp's regexes on the standard library's `re`.

A pre-tokenizer is a list of steps applied in turn, as the `tokenizers` Sequence the converter writes to
tokenizer.json (models/convert/tokenizer_gguf.py): each step splits every piece so far into its matches and
the gaps between them ("isolated"). A step is a regex (a Split, or ByteLevel's own GPT-2 regex) or a
Digits pre-tokenizer (numeric characters one by one, or in runs).

`re` has no \\p{L}: the classes the regexes use are spelled out from models/runtime/unicode_classes.py,
which holds what the `tokenizers` engines match (Oniguruma for regexes, Rust's is_numeric for Digits), so
that the pieces are the same whatever Unicode version this Python has.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

from models.errors import InvalidModelFile
from models.runtime import unicode_classes

# A step as the converter records it: ("regex", pattern in llama.cpp's syntax), ("digits", "1": one by one,
# or "": in runs).
Step = tuple[str, str]
STEP_REGEX = "regex"
STEP_DIGITS = "digits"

SPACE = r"\s"
_CLASSES = {
    r"\p{L}": unicode_classes.LETTER,
    r"\p{N}": unicode_classes.NUMBER,
    r"\p{M}": unicode_classes.MARK,
    r"\p{P}": unicode_classes.PUNCTUATION,
    SPACE: unicode_classes.SPACE,
}
_ESCAPE = re.compile(r"\\p\{[A-Za-z]+\}|\\[sS]|\\.|\[|\]|.", re.DOTALL)


def _class_body(ranges: str) -> str:
    """The inside of a `re` character class holding these ranges ("41-5a 61 ...")."""
    out = []
    for word in ranges.split():
        first, _, last = word.partition("-")
        out.append(f"\\U{int(first, 16):08x}" + (f"-\\U{int(last, 16):08x}" if last else ""))
    return "".join(out)


@cache
def _body(name: str) -> str:
    return _class_body(_CLASSES[name])


def translate(pattern: str) -> str:
    """A regex in llama.cpp's (Oniguruma's) syntax as a `re` pattern: \\p{L}, \\p{N}, \\p{M}, \\p{P}, \\s
    and \\S become explicit classes, inside brackets or out; everything else means the same to `re`."""
    out: list[str] = []
    in_class = False
    for m in _ESCAPE.finditer(pattern):
        token = m.group()
        if token == "[" and not in_class:
            in_class = True
            out.append(token)
        elif token == "]" and in_class:
            in_class = False
            out.append(token)
        elif token in _CLASSES:
            out.append(_body(token) if in_class else f"[{_body(token)}]")
        elif token == r"\S":
            if in_class:
                raise InvalidModelFile(f"pre-tokenizer regex {pattern!r}: no \\S inside a class")
            out.append(f"[^{_body(SPACE)}]")
        elif token.startswith(r"\p"):
            raise InvalidModelFile(f"pre-tokenizer regex {pattern!r}: the class {token} is not supported")
        else:
            out.append(token)
    return "".join(out)


def compile_step(step: Step) -> re.Pattern[str]:
    kind, arg = step
    if kind == STEP_REGEX:
        try:
            return re.compile(translate(arg))
        except re.error as e:
            raise InvalidModelFile(f"pre-tokenizer regex {arg!r}: {e}") from e
    if kind == STEP_DIGITS:
        numeric = _class_body(unicode_classes.NUMERIC)
        return re.compile(f"[{numeric}]" if arg else f"[{numeric}]+")
    raise InvalidModelFile(f"unknown pre-tokenizer step {kind!r}")


class PreTokenizer:
    """The steps compiled; `split` gives the pieces of a text between special tokens."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)
        self._patterns = [compile_step(s) for s in self.steps]

    def split(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for pattern in self._patterns:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in pattern.finditer(piece):
                    start, end = m.span()
                    if start == end:
                        continue  # an empty match splits nothing
                    if start > pos:
                        out.append(piece[pos:start])
                    out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces
