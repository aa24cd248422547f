"""What the worker tells a job's stream besides tokens: the reply started, moved to another model, failed, or
the governor's state changed. Dialects encode these; they import them from here, not from the worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    truncated: bool
    variant: str | None = None
    model_id: str | None = None  # the model that runs it (None: the requested one)
    summarized: bool = False  # the window's dropped turns are in the prompt as a summary note


@dataclass(frozen=True)
class Switched:
    """The reply moved to another model mid-way (the governor's rung moved)."""

    old: str  # model/variant
    model_id: str
    variant: str
    reason: str
    tokens: int  # generated before the switch


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class GovernorUpdate:
    """The governor's state as a stream shows it (level, reason, limits), when it changes mid-reply; the
    governor's own decision state is governor/policy.py's GovernorState."""

    state: Mapping[str, Any]
