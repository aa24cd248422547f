"""Tool calls: how a model is told about tools, the grammar its calls must follow, and reading them back.

The call format is the one the model was trained on when its chat template shows one, else simmer's
(the Hermes format, which many small models know):

- `hermes` (Qwen 2.5/3, Hermes, SmolLM3; the template writes `<tool_call>`): each call is
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, several separated by a newline.
- `llama3` (Llama 3.1-3.3: the template asks for `{"name": function name, "parameters": ...}`): each call is
  `{"name": "f", "parameters": {...}}`, several separated by "; " (as vLLM's llama3_json parser reads them).
- `simmer`: a template that does not take `tools` (SmolLM2, Gemma 3) or shows no known format. The Hermes
  call format, with the tools described in a system message (TOOLS_PROMPT) and earlier calls and results
  written into the turns as text (`<tool_call>` in the assistant turn, `<tool_response>` in a user turn).

The grammar spells each call's envelope literally (so the parser below can rely on it) around the function's
argument schema. `required` and a named function allow calls only; `auto` allows text (that does not start
like a call) or calls. `tool_choice: none` uses no grammar and does not show the tools to the model.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.meta

from models.runtime.constraint import json_lark, lark_grammar
from models.runtime.loose_calls import LooseScan, parse
from models.types import Tool, ToolCallDelta, ToolUse

FormatName = Literal["hermes", "llama3", "simmer"]


@dataclass(frozen=True)
class CallFormat:
    name: FormatName
    opener: str  # before the function name
    middle: str  # between the name and the arguments object
    closer: str  # after the arguments object
    separator: str  # between two calls
    template_renders_tools: bool  # the template gets `tools=` and the messages' tool_calls as they are


HERMES_OPENER = '<tool_call>\n{"name": "'
FORMATS: dict[FormatName, CallFormat] = {
    "hermes": CallFormat("hermes", HERMES_OPENER, '", "arguments": ', "}\n</tool_call>", "\n", True),
    "llama3": CallFormat("llama3", '{"name": "', '", "parameters": ', "}", "; ", True),
    "simmer": CallFormat("simmer", HERMES_OPENER, '", "arguments": ', "}\n</tool_call>", "\n", False),
}

TOOLS_PROMPT = (
    "You can call functions to help answer. Their signatures, as JSON, are within <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def detect_format(template_source: str | None) -> CallFormat:
    """The call format of a chat template: one that takes `tools` and shows a known format, else simmer's."""
    if not template_source:
        return FORMATS["simmer"]
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template_source))
    except jinja2.TemplateSyntaxError:
        return FORMATS["simmer"]
    if "tools" not in names and "custom_tools" not in names:
        return FORMATS["simmer"]
    if "<tool_call>" in template_source:
        return FORMATS["hermes"]
    if '"parameters": dictionary of argument name' in template_source:
        return FORMATS["llama3"]
    return FORMATS["simmer"]


# ---- the prompt ------------------------------------------------------------------------------------


def tool_json(tool: Tool) -> dict[str, Any]:
    """A tool as OpenAI's request has it (what tool-aware templates expect in `tools`)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _arguments(value: Any) -> Any:
    """Hugging Face templates expect a call's arguments as a mapping (`| tojson`); OpenAI sends a string."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _call_text(fmt: CallFormat, call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    args = _arguments(function.get("arguments", {}))
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return fmt.opener + str(function.get("name", "")) + fmt.middle + args_text + fmt.closer


def prepare_messages(
    messages: list[dict[str, Any]], tools: ToolUse | None, fmt: CallFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for rendering the chat template.

    A template that renders tools itself gets them, and the history's calls with their arguments as
    mappings. Otherwise the tools are described in the system message and the history's calls and results
    become text (results in user turns, as Qwen's template writes them), since such templates know only
    system, user and assistant turns."""
    shown = tools if tools is not None and tools.choice != "none" else None
    if fmt.template_renders_tools:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [
                    {
                        **c,
                        "function": {
                            **c.get("function", {}),
                            "arguments": _arguments(c["function"].get("arguments")),
                        },
                    }
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, [tool_json(t) for t in shown.tools] if shown else None
    out = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            text = "\n".join(_call_text(fmt, c) for c in m["tool_calls"])
            content = m.get("content") or ""
            content = content if isinstance(content, str) else ""
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + text})
        elif role == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if shown:
        described = TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(tool_json(t), ensure_ascii=False) for t in shown.tools)
        )
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _text(out[0].get("content")) + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# ---- the grammar -----------------------------------------------------------------------------------


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(tools: ToolUse, fmt: CallFormat) -> str | None:
    """The llguidance grammar a reply follows (None for tool_choice "none": free text)."""
    if tools.choice == "none":
        return None
    chosen = [t for t in tools.tools if tools.choice in ("auto", "required") or t.name == tools.choice]
    rules = []
    for i, tool in enumerate(chosen):
        schema = tool.parameters if tool.parameters is not None else {"type": "object"}
        rules.append(
            f"call_{i}: {_lit(fmt.opener + tool.name + fmt.middle)} {json_lark(schema)} {_lit(fmt.closer)}"
        )
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    calls = f"calls: call ({_lit(fmt.separator)} call)*" if tools.parallel else "calls: call"
    if tools.choice == "auto":
        # Text that does not begin like a call (an empty reply is no answer: at least one character).
        start = f"start: TEXT | calls\nTEXT: /(?s:.+)/ & ~/{_regex_literal(fmt.opener)}(?s:.*)/"
    else:
        start = "start: calls"
    return lark_grammar("\n".join([start, calls, call, *rules]) + "\n")


def _regex_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch.isalnum() or ch in " _":
            out.append(ch)
        else:
            out.append("\\" + ch if ch in r".^$*+?()[]{}|\/-" else ch)
    return "".join(out)


# ---- reading calls back -----------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallReader:
    """Splits a constrained reply's text, delta by delta, into content and tool-call deltas.

    It relies on the grammar: calls are spelled exactly as the format's envelope, so reading is matching
    literals and finding where the arguments object ends (depth counting outside JSON strings). In `auto`
    text that starts like the envelope is held until it either becomes a call or cannot be one; so is text
    that may be a call written the model's own way (models/runtime/loose_calls.py: one JSON object, bare
    or fenced, or the template's markup), which becomes a call if the reply ends as one (`flush`)."""

    def __init__(self, fmt: CallFormat, tools: ToolUse | None = None) -> None:
        self.fmt = fmt
        self.calls = 0  # calls started
        self._buf = ""  # text not yet classified
        self._state = "start"  # start | content | loose | opener | name | middle | args | closer | between
        # `auto`: the declared functions a loosely written call may name
        self._tools = tools.tools if tools is not None and tools.choice == "auto" else ()
        self._parallel = tools.parallel if tools is not None else True
        self._loose: LooseScan | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._name = ""

    @property
    def in_calls(self) -> bool:
        return self._state not in ("start", "content", "loose")

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text and call deltas for the next piece of reply text."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._buf += text
        while self._buf:
            if not self._step(content, deltas):
                break
        return "".join(content), _merge(deltas)

    def flush(self, complete: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """At the reply's end: held text that never became a call is content. `complete`: the reply ended
        on its own (not cut by a length): held text that reads as a loosely written call is that call."""
        if self._state == "loose":
            assert self._loose is not None
            held = "".join(self._loose.text)
            calls = parse(self._loose, self._tools) if complete else None
            self._loose = None
            if not calls:
                self._state = "content"
                return held, []
            deltas = []
            for call in calls:
                deltas.append(ToolCallDelta(self.calls, new_call_id(), call.name, ""))
                deltas.append(ToolCallDelta(self.calls, None, None, call.arguments))
                self.calls += 1
            self._state = "between"
            return "", deltas  # the name first (arguments ""), then the arguments, as a stream has them
        if self._state in ("start", "content"):
            held, self._buf = self._buf, ""
            return held, []
        self._buf = ""
        return "", []

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume some of the buffer; False when more text is needed."""
        f = self.fmt
        if self._state == "content":
            content.append(self._buf)
            self._buf = ""
            return True
        if self._state == "loose":
            assert self._loose is not None
            piece, self._buf = self._buf, ""
            if not self._loose.feed(piece):  # it cannot be a call any more: all of it is text
                content.append("".join(self._loose.text))
                self._loose = None
                self._state = "content"
                return True
            return False
        if self._state in ("start", "opener", "between"):
            want = (f.separator + f.opener) if self._state == "between" else f.opener
            n = min(len(self._buf), len(want))
            if self._buf[:n] != want[:n]:
                if self._state == "start":
                    self._state = "content"
                    if self._tools:
                        self._loose = LooseScan(
                            self._tools, markup=f.name != "llama3", parallel=self._parallel
                        )
                        self._state = "loose"
                    return True
                raise ValueError(f"tool call text does not follow the {f.name} format: {self._buf!r}")
            if n < len(want):
                return False  # a prefix of the envelope: wait
            self._buf = self._buf[len(want) :]
            self._state, self._name = "name", ""
            return True
        if self._state == "name":
            end = self._buf.find('"')
            if end < 0:
                self._name += self._buf
                self._buf = ""
                return False
            self._name += self._buf[:end]
            self._buf = self._buf[end + 1 :]
            deltas.append(ToolCallDelta(self.calls, new_call_id(), self._name, ""))
            self.calls += 1
            self._state = "middle"
            return True
        if self._state == "middle":
            rest = f.middle[1:]  # the closing quote of the name was consumed
            n = min(len(self._buf), len(rest))
            if self._buf[:n] != rest[:n]:
                raise ValueError(f"tool call text does not follow the {f.name} format: {self._buf!r}")
            if n < len(rest):
                return False
            self._buf = self._buf[len(rest) :]
            self._state, self._depth, self._in_string, self._escape = "args", 0, False, False
            return True
        if self._state == "args":
            end = self._args_end()
            piece = self._buf if end is None else self._buf[:end]
            if piece:
                deltas.append(ToolCallDelta(self.calls - 1, None, None, piece))
            self._buf = "" if end is None else self._buf[end:]
            if end is None:
                return False
            self._state = "closer"
            return True
        if self._state == "closer":
            n = min(len(self._buf), len(f.closer))
            if self._buf[:n] != f.closer[:n]:
                raise ValueError(f"tool call text does not follow the {f.name} format: {self._buf!r}")
            if n < len(f.closer):
                return False
            self._buf = self._buf[len(f.closer) :]
            self._state = "between"
            return True
        raise AssertionError(self._state)

    def _args_end(self) -> int | None:
        """The index just past the arguments object in the buffer, or None if it does not end there."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent argument pieces of one call as one delta."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].index == d.index:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out
