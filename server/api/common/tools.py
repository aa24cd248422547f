"""The rules every dialect's tools follow, compile-free (what only compiling finds is the parse's): one
function per name, a named tool_choice among the tools, parameters that describe an object. Each dialect
passes its own field paths, so the error names the field as the client wrote it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.api.common.fields import invalid


def check_tools(
    names: Sequence[str],
    parameters: Sequence[dict[str, Any] | None],
    *,
    choice_given: bool,
    chosen: str | None,
    params_path: Callable[[int], str],
) -> None:
    """`chosen`: the function a named tool_choice names (None: not a named choice)."""
    if len(set(names)) != len(names):
        raise invalid("tools: function names must be unique", "tools")
    if choice_given and not names:
        raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
    if chosen is not None and chosen not in names:
        raise invalid(f"tool_choice names {chosen!r}, which is not among the tools", "tool_choice")
    for i, schema in enumerate(parameters):
        kind = (schema or {}).get("type", "object")
        if kind != "object":
            path = params_path(i)
            raise invalid(f"{path} must describe an object (type 'object'), not {kind!r}", path)
