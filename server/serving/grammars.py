"""The one seam through which the server turns what a request asks for into a grammar and checks it.

A request's response grammar (a JSON schema, OpenAI's json_object, a GBNF grammar) and each tool's
parameter schema are converted once per request and checked once, before any work is queued; every
dialect reaches them through this seam, so a test can count the conversions (a fake through the real
seam). What a model does with a grammar afterwards (a matcher over its own tokenizer, the call grammar in
its own call format) is the engine's, per reply: it depends on the model.
"""

from __future__ import annotations

from typing import Any, Protocol

from models.runtime.constraint import GRAMMAR_CHECKS, check_grammar, gbnf_grammar, json_schema_grammar


class Grammars(Protocol):
    def json_schema(self, schema: dict[str, Any] | None, param: str) -> str:
        """The grammar of JSON valid against `schema` (None: any JSON object); InvalidParameter(param)
        for a schema that cannot be compiled safely."""
        ...

    def gbnf(self, text: str, param: str) -> str:
        """A llama.cpp GBNF grammar, converted; InvalidParameter(param) for one that cannot be."""
        ...

    def check(self, grammar: str, param: str) -> None:
        """Compile `grammar` and compute its first mask; InvalidParameter(param) with the reason. CPU work
        that drops the GIL: the server runs it on CHECKS, never on the event loop."""
        ...


class Llguidance:
    """The real one: llguidance, bounded (models/runtime/constraint.py)."""

    def json_schema(self, schema: dict[str, Any] | None, param: str) -> str:
        return json_schema_grammar(schema, param)

    def gbnf(self, text: str, param: str) -> str:
        return gbnf_grammar(text, param)

    def check(self, grammar: str, param: str) -> None:
        check_grammar(grammar, param)


LLGUIDANCE = Llguidance()

# Where the server checks a request's grammars: one thread with a large stack (a burst of requests queues
# here instead of taking every core and the event loop's share of the GIL).
CHECKS = GRAMMAR_CHECKS
