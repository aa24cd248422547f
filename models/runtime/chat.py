"""Chat templates: the GGUF's Jinja template rendered in a sandbox, the way Hugging Face renders it.

A chat template comes with a downloaded model, so it is untrusted code: it runs in Jinja's
ImmutableSandboxedEnvironment, and any unsafe attribute access (`''.__class__`, `list.append`, ...)
raises instead of quietly rendering nothing. Messages are validated before rendering so a bad
request names the offending field (`messages[1].role`).

A model without a template (a base model) has no chat: there is no stand-in template, since a wrong one
makes a base model ramble. `render_marked` tells which characters of the prompt came from the messages, so
that special-token texts there (a "<|im_end|>" inside a message) stay text and cannot forge a turn.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.errors import InvalidParameter, UnsupportedModel
from models.runtime.tokenizer import Span, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class TemplateRaised(Exception):
    """What a template's raise_exception() throws: the template rejects these messages."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        # The stock sandbox returns an Undefined that prints as "", so `{{ ''.__class__ }}` would
        # render silently. A template that probes internals is broken or hostile: fail loudly.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: unlike Jinja's, it does not HTML-escape and keeps non-ASCII text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""  # an assistant turn that only carried tool calls
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidParameter(
                    f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                    "this model accepts text only",
                    param=f"{where}[{j}]",
                )
            texts.append(part["text"])
        # Joined with newlines, as vLLM does for multi-part text content.
        return "\n".join(texts)
    raise InvalidParameter(f"{where} must be a string or a list of text parts", param=where)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check roles and content; return copies with content flattened to a string."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidParameter("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidParameter(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidParameter(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        clean = dict(msg)
        clean["content"] = _content_text(msg.get("content"), f"messages[{i}].content")
        out.append(clean)
    return out


class ChatTemplate:
    """A compiled chat template. `render(messages)` gives the prompt text, to be tokenized with
    add_special_tokens=False (the template writes any BOS it wants itself)."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", special_texts: Iterable[str] = ()
    ) -> None:
        if not source:
            raise ValueError("a chat template needs its source")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_texts = tuple(sorted({t for t in special_texts if t}, key=len, reverse=True))
        try:
            self._template = _environment().from_string(self.source)
        except TemplateError as e:
            raise UnsupportedModel(f"the chat template does not compile: {e}") from e

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, source: str | None = None) -> ChatTemplate | None:
        """`source` (an operator's template) or the tokenizer's own, with its bos/eos and special-token
        texts; None when there is neither (the model serves completions only)."""
        source = source or tokenizer.chat_template
        if not source:
            return None
        return cls(
            source,
            bos_token=tokenizer.text_of(tokenizer.bos_id) or "",
            eos_token=tokenizer.text_of(tokenizer.eos_id) or "",
            special_texts=(tokenizer.text_of(i) or "" for i in tokenizer.special_ids),
        )

    def render(self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render validated messages. `extra` (for example tools=...) is passed to the template."""
        return self._render(validate_messages(messages), add_generation_prompt, extra)

    def render_marked(
        self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any
    ) -> tuple[str, list[Span]]:
        """The rendered prompt and the (start, end) spans of special-token texts that came from the
        messages rather than from the template: the tokenizer keeps those as text.

        Each such text is swapped for an unguessable private-use placeholder before rendering, so the
        template's own string operations (trim, split, ...) work as usual; the placeholders are swapped
        back afterwards. Messages without special-token texts render exactly as render() does."""
        clean = validate_messages(messages)
        if not self.special_texts:
            return self._render(clean, add_generation_prompt, extra), []
        nonce = str(secrets.randbelow(10**12))  # digits: unchanged by |upper, |lower, |trim
        originals: list[str] = []

        def hide(m: re.Match[str]) -> str:
            originals.append(m.group())
            return f"\ue000{nonce}:{len(originals) - 1}\ue001"

        hidden = [_map_strings(msg, lambda t: self._specials.sub(hide, t), skip=("role",)) for msg in clean]
        # tools=... comes from the request too: its texts are as untrusted as the messages'
        extra = {k: _map_strings(v, lambda t: self._specials.sub(hide, t)) for k, v in extra.items()}
        text = self._render(hidden, add_generation_prompt, extra)
        if not originals:
            return text, []
        out: list[str] = []
        spans: list[Span] = []
        pos = size = 0
        for m in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
            out.append(text[pos : m.start()])
            size += m.start() - pos
            original = originals[int(m.group(1))]
            out.append(original)
            spans.append((size, size + len(original)))
            size += len(original)
            pos = m.end()
        out.append(text[pos:])
        return "".join(out), spans

    @cached_property
    def _specials(self) -> re.Pattern[str]:
        # longest first: at one position the longest special text wins, as in the tokenizer
        return re.compile("|".join(re.escape(t) for t in self.special_texts))

    def _render(self, clean: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        try:
            return self._template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateRaised as e:
            raise InvalidParameter(
                f"the model's chat template rejected the messages: {e}", param="messages"
            ) from e
        except SecurityError as e:
            raise UnsupportedModel(f"the model's chat template attempted an unsafe operation: {e}") from e
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidParameter(
                f"the model's chat template could not render these messages: {e}", param="messages"
            ) from e


def _map_strings(value: Any, fn: Callable[[str], str], skip: Sequence[str] = ()) -> Any:
    """`value` with `fn` applied to every string in it (dict keys and values, list items), but not to the
    top-level `skip` keys' values. (A key is data too: a tool schema's property names are rendered.)"""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {
            (fn(k) if isinstance(k, str) else k): v if k in skip else _map_strings(v, fn)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def encode_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: Any, **extra: Any) -> list[int]:
    """The prompt ids of a conversation. Special-token texts inside the messages stay text, so only the
    template's own markup opens and closes turns; messages without them give exactly the ids of
    tokenizing the rendered text. One BOS leads when the model wants it, whether or not the template
    writes it (llama.cpp strips the template's and adds its own)."""
    text, literal = template.render_marked(messages, **extra)
    ids = tokenizer.encode(text, add_special_tokens=False, literal_spans=literal)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids
