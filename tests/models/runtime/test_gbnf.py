"""llama.cpp GBNF -> llguidance Lark (models/runtime/gbnf.py): the same Lark as llguidance's own converter,
in linear time, within fixed bounds."""

from __future__ import annotations

import time

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark as llguidance_gbnf_to_lark

from models.errors import InvalidParameter
from models.runtime.constraint import check_grammar, gbnf_grammar
from models.runtime.gbnf import MAX_CHARS, MAX_NESTING, MAX_RULES, gbnf_to_lark

GRAMMARS = {
    "arithmetic": """
root  ::= (expr "=" ws term "\\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \\t\\n]*
""",
    "json-like": """
# a comment
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\\"" ( [^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws ::= | " " | "\\n" [ \\t]{0,20}
""",
    "names": """
root ::= firstRule second-rule
firstRule ::= "a"? "b"{2,3} .
second-rule ::= firstRule | "c"
""",
}


def chain(n: int) -> str:
    """`n` rules, each referring to the next: right recursion, as the grammar that froze the server."""
    rules = ["root ::= r0", *(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(n - 2)), f'r{n - 2} ::= "c"']
    return "\n".join(rules)


def tokens(lark: str) -> list[str]:
    return lark.replace("\n     |", " |").split()


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_gbnf_when_converted_then_the_same_lark_as_llguidances_converter(name: str) -> None:
    text = GRAMMARS[name]
    assert tokens(gbnf_to_lark(text)) == tokens(llguidance_gbnf_to_lark(text))
    check_grammar(gbnf_grammar(text), "grammar")


def test_gbnf_when_a_long_chain_then_converted_in_linear_time() -> None:
    """llguidance's converter rescans every rule once per rule of a chain: 1,000 rules took 6 s here
    (shared machine), 3,000 rules 7.3 s on a quiet one. Linear, the longest chain allowed takes well
    under a second."""
    text = chain(MAX_RULES)
    started = time.perf_counter()
    grammar = gbnf_grammar(text)
    took = time.perf_counter() - started
    assert took < 2.0, took
    check_grammar(grammar, "grammar")  # and the deepest chain allowed compiles


def test_gbnf_when_over_the_bounds_then_refused_with_the_reason() -> None:
    with pytest.raises(InvalidParameter, match=f"{MAX_RULES + 1} rules, at most {MAX_RULES}") as err:
        gbnf_grammar(chain(MAX_RULES + 1))
    assert err.value.param == "grammar"
    with pytest.raises(InvalidParameter, match=f"over {MAX_CHARS} characters"):
        gbnf_grammar('root ::= "' + "a" * MAX_CHARS + '"')
    deep = "root ::= " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1)
    with pytest.raises(InvalidParameter, match="nested deeper"):
        gbnf_grammar(deep)
    ok = "root ::= " + "(" * MAX_NESTING + '"a"' + ")" * MAX_NESTING
    check_grammar(gbnf_grammar(ok), "grammar")


@pytest.mark.parametrize(
    "text, words",
    [
        ("root ::= (", "Expected '\\)'"),
        ('root ::= other\nx ::= "a"', "rule 'other' is not defined"),
        ('start ::= "a"', "no 'root' rule"),
        ('root ::= start\nstart ::= "a" start | "b"', "two rules are both named 'start'"),
    ],
)
def test_gbnf_when_invalid_then_400_naming_why(text: str, words: str) -> None:
    with pytest.raises(InvalidParameter, match=words) as err:
        gbnf_grammar(text, "grammar")
    assert err.value.param == "grammar"
