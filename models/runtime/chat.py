"""Chat templates: the GGUF's Jinja template rendered in a sandbox, the way Hugging Face renders it.

A chat template comes with a downloaded model, so it is untrusted code: it runs in Jinja's
ImmutableSandboxedEnvironment, and any unsafe attribute access (`''.__class__`, `list.append`, ...)
raises instead of quietly rendering nothing. Messages are validated before rendering so a bad
request names the offending field (`messages[1].role`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.errors import InvalidParameter, UnsupportedModel
from models.runtime.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template: plain ChatML, no default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        self.is_fallback = not source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except TemplateError as e:
            raise UnsupportedModel(f"the model's chat template does not compile: {e}") from e

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The tokenizer's own template (ChatML when it has none), with its bos/eos texts."""

        def text(i: int | None) -> str:
            return "" if i is None else tokenizer.hf.id_to_token(i) or ""

        return cls(
            tokenizer.chat_template, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id)
        )

    def render(self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render validated messages. `extra` (for example tools=...) is passed to the template."""
        clean = validate_messages(messages)
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
