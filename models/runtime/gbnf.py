"""llama.cpp's GBNF grammars as llguidance Lark, in time linear in the grammar and within fixed bounds.

llguidance ships a converter (llguidance.gbnf_to_lark); its parser is reused here, not its `resolve` step:
that finds the rules that are pure terminals by rescanning every rule until nothing changes, once per rule of
a chain, so a chain of n rules took n passes (2,000 rules 2.9 s, 3,000 7.3 s, measured). Here a rule is a
terminal once the last rule it references is (a count per rule, each reference visited once).

llguidance compiles a chain of rules (each referencing the next) recursively, about 3 KB of native stack
per rule: a chain of 4,000 overflowed an 8 MB thread stack and killed the process, 2,500 did not (measured,
whether the chain is of terminals, one nested regular expression, or of grammar rules). The bounds refuse
what is too large to convert or compile safely and quickly: `MAX_CHARS` of text, `MAX_RULES` rules (a chain of
them fits a default 8 MB stack 2.5 times over, and the grammar threads' stack far more), `MAX_NESTING` levels
of parentheses.
"""

from __future__ import annotations

import re
from collections import deque

from llguidance.gbnf_to_lark import (
    ASTNode,
    GbnfToLarkError,
    GrammarParser,
    Position,
    RuleNode,
    RuleRefNode,
)

from models.errors import InvalidParameter

MAX_CHARS = 65_536
MAX_RULES = 1_000
MAX_NESTING = 32


class _BoundedParser(GrammarParser):
    """llguidance's GBNF parser, refusing parentheses nested deeper than MAX_NESTING."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def _parse_group(self, pos: Position, is_nested: bool) -> tuple[ASTNode, Position]:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise GbnfToLarkError(pos, f"parentheses nested deeper than {MAX_NESTING}")
        try:
            return super()._parse_group(pos, is_nested)
        finally:
            self.depth -= 1


def gbnf_to_lark(text: str, param: str = "grammar") -> str:
    """The Lark grammar (llguidance's dialect) of a GBNF grammar. Raises InvalidParameter(param) naming
    what is wrong or too large."""
    if len(text) > MAX_CHARS:
        raise InvalidParameter(f"{param}: over {MAX_CHARS} characters", param=param)
    try:
        rules = _BoundedParser().parse(text)
    except (GbnfToLarkError, RecursionError) as e:
        raise InvalidParameter(f"{param}: {_short(str(e))}", param=param) from None
    if len(rules) > MAX_RULES:
        raise InvalidParameter(f"{param}: {len(rules)} rules, at most {MAX_RULES}", param=param)
    ordered = list(rules.values())
    for rule in ordered:
        rule.alternatives = rule.alternatives.simplify()
    refs = {rule.name: _references(rule) for rule in ordered}
    for rule in ordered:
        for node in refs[rule.name]:
            target = rules.get(node.name)
            if target is None:
                raise InvalidParameter(f"{param}: rule '{node.name}' is not defined", param=param)
            node.target = target
    root = rules.get("root")
    if root is None:
        raise InvalidParameter(f"{param}: no 'root' rule", param=param)
    _mark_terminals(ordered, refs, root)
    return _render(ordered, root, param)


def _references(rule: RuleNode) -> list[RuleRefNode]:
    """Every rule reference in the rule's body (iteratively: the body nests at most MAX_NESTING groups,
    but a walk without recursion costs nothing)."""
    out: list[RuleRefNode] = []
    todo: list[ASTNode] = [rule.alternatives]
    while todo:
        node = todo.pop()
        if isinstance(node, RuleRefNode):
            out.append(node)
        todo.extend(node.children())
    return out


def _mark_terminals(rules: list[RuleNode], refs: dict[str, list[RuleRefNode]], root: RuleNode) -> None:
    """The least fixpoint llguidance's converter computes (a rule other than root is a terminal when
    every rule it references is), as a worklist: each rule and each reference visited once."""
    waiting = {r.name: len({n.name for n in refs[r.name]}) for r in rules}
    users: dict[str, list[RuleNode]] = {r.name: [] for r in rules}
    for r in rules:
        for name in {n.name for n in refs[r.name]}:
            users[name].append(r)
    ready = deque(r for r in rules if waiting[r.name] == 0 and r is not root)
    while ready:
        rule = ready.popleft()
        rule.rule_is_terminal = True
        for user in users[rule.name]:
            waiting[user.name] -= 1
            if waiting[user.name] == 0 and user is not root:
                ready.append(user)


def _render(rules: list[RuleNode], root: RuleNode, param: str) -> str:
    """Lark text, with the names llguidance's converter gives (root -> start; terminals upper case)."""
    names: set[str] = set()
    for rule in rules:
        if rule is root:
            name = "start"
        else:
            name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_")).lower()
            name = name.upper() if rule.rule_is_terminal else name
        if name in names:
            raise InvalidParameter(f"{param}: two rules are both named '{name}' in Lark", param=param)
        names.add(name)
        rule.name = name
    parts = ["%llguidance {}\n\n"]
    for rule in rules:
        parts.append(f"{rule}\n\n")
    return "".join(parts)


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
