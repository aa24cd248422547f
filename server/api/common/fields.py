"""What every dialect's request validation shares."""

from __future__ import annotations

from pydantic_core import PydanticCustomError


def invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A 400 invalid_parameter raised inside a validator. A custom error keeps our exact wording (a
    ValueError would be prefixed "Value error, "); `param` names the field when the error is raised above it
    (server/http/errors.py reads it)."""
    return PydanticCustomError("invalid_parameter", message, {"param": param} if param else None)
