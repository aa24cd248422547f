"""A dialect's request as the OpenAI request the shared flow takes, with whatever the OpenAI request refuses
named in the dialect's own words: Ollama's `format` is the OpenAI request's `response_format`, the
Responses API's `tools[0].parameters` its `tools[0].function.parameters`.

The dialect's validator builds the OpenAI request once (`openai_request`), so a refusal is a 400 from
the dialect's validation, before any work; the same renaming covers what only compiling the grammar finds
(`renamed`, around completion_flow.start).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from models.errors import InvalidParameter
from server.api.openai.protocol import _invalid
from server.http.errors import param_path

T = TypeVar("T", bound=BaseModel)


class Renamer:
    """OpenAI field paths -> the dialect's: (regex, replacement) rules, the first that matches applies."""

    def __init__(self, *rules: tuple[str, str]) -> None:
        self.rules = [(re.compile(pattern), repl) for pattern, repl in rules]

    def __call__(self, param: str) -> str:
        for pattern, repl in self.rules:
            new, n = pattern.subn(repl, param, count=1)
            if n:
                return new
        return param

    def message(self, message: str, param: str | None) -> tuple[str, str | None]:
        """The message and param with the param renamed (messages name the field they are about)."""
        if not param:
            return message, param
        new = self(param)
        return message.replace(param, new), new


def openai_request(model: type[T], fields: dict[str, Any], rename: Renamer) -> T:
    """`model.model_validate(fields)`, or the first refusal as an invalid_parameter error (raised inside a
    dialect's validator, it becomes that request's 400) naming the dialect's field."""
    try:
        return model.model_validate(fields)
    except ValidationError as err:
        first = max(err.errors(), key=lambda e: len(e.get("loc", ())))
        ctx = first.get("ctx") or {}
        own = first.get("type") == "invalid_parameter"
        param = (ctx.get("param") if own else None) or param_path(tuple(first.get("loc", ())), fields)
        message = first.get("msg", "invalid request")
        if not own and param:
            message = f"{param}: {message}"
        raise _dialect_error(message, param, rename) from None
    except InvalidParameter as err:
        raise _dialect_error(err.message, err.param, rename) from None


def _dialect_error(message: str, param: str | None, rename: Renamer) -> PydanticCustomError:
    message, param = rename.message(message, param)
    return _invalid(message, param)


def renamed(err: InvalidParameter, rename: Renamer) -> InvalidParameter:
    """An error the shared flow raised (a grammar that does not compile) in the dialect's words."""
    message, param = rename.message(err.message, err.param)
    return InvalidParameter(message, param=param)
