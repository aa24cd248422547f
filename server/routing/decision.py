"""Where a request is served: a pure function from what is known now to a side and a reason.

No clock, no I/O: the router (router.py) gathers the inputs (settings, the request, the breaker, the
governor's state through a read-only seam, the worker's state) and acts on the decision. Tests drive it
table by table (tests/server/routing/test_policy.py), like governor/policy.py's decide().
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from server.serving.request import Mode

Side = Literal["local", "upstream"]
# The local model: ready, loading, no variant fits the memory budget, failed to load otherwise, shut down.
LocalState = Literal["ready", "loading", "no_memory", "failed", "closed"]
MODES: tuple[Mode, ...] = ("local", "auto", "upstream")
# What the request asks of a side: a reply to generate (chat, completions, Responses) or vectors to embed.
Work = Literal["generate", "embed"]

# Refusals, as error codes of the server's vocabulary (server/http/errors.py).
NOT_ALLOWED = "upstream_not_allowed"
UNAVAILABLE = "upstream_unavailable"
NOT_FOUND = "model_not_found"


@dataclass(frozen=True)
class DeviceState:
    """The governor's state as routing sees it (server/routing/router.py reads it from the gate)."""

    level: str  # nominal | fair | serious | critical
    paused: bool = False  # new work is held
    lifecycle: str = "foreground"
    cause: str = "none"  # thermal | memory | battery | lifecycle | none
    killed: bool = False  # the (simulated) device stopped the app; local work fails until it cools
    # The decode pace (tokens/s) the governor allows now because of heat: set only while the cause is
    # thermal and its CPU budget binds, and the cost of a token is known; None otherwise (not thermally
    # limited, or no known cost: the pace rules below then never fire).
    pace_tok_s: float | None = None


@dataclass(frozen=True)
class RouteInputs:
    policy: Mode  # SIMMER_ROUTE
    requested: Mode | None  # the request's `route` field / X-Simmer-Route header, combined
    upstream_available: bool  # configured, and the breaker lets a request through
    model_local: bool  # the model is served here
    model_upstream: bool  # the upstream serves it (a local id forwarded, or an upstream-only id)
    local: LocalState = "ready"
    device: DeviceState | None = None  # None: no governor
    queue_full: bool = False
    prompt_over_context: bool = False  # learnt from the worker: the prompt exceeds the local context cap
    truncate: bool = False  # the request asked for sliding-window truncation instead
    pace_slow: bool = False  # pace_slow(): the local pace is below SIMMER_ROUTE_MIN_LOCAL_TOK_S (hysteresis)
    local_tokens_ahead: int = 0  # tokens the local worker generates before a new job starts (upper bound)
    max_local_wait_s: float = 0.0  # SIMMER_ROUTE_MAX_LOCAL_WAIT_S; 0: no bound
    # embed: the rows about the generation model (`local`), the pace and the context do not apply
    work: Work = "generate"


@dataclass(frozen=True)
class Decision:
    side: Side | None  # None: refused with `refusal`
    reason: str
    fallback: bool = False  # upstream: serve locally if the upstream fails before the first token
    refusal: str | None = None


def strictest(*modes: Mode | None) -> Mode | None:
    """The request's mode from its field and its header: forbidding upstream always wins."""
    given = [m for m in modes if m is not None]
    return min(given, key=MODES.index) if given else None


# The rule table. The first matching row wins.
#
#   policy    request    condition                                  -> side            reason
#   local     upstream                                              -> refused         upstream_not_allowed
#   local     other      model not local                            -> refused         model_not_found
#   local     other                                                 -> local           policy
#   any       local      model not local                            -> refused         model_not_found
#   any       local                                                 -> local           request
#   any       upstream   model not served upstream                  -> refused         model_not_found
#   any       upstream   upstream unavailable                       -> refused         upstream_unavailable
#   any       upstream                                              -> upstream        request (no fallback)
#   upstream  none       model not served upstream, model local     -> local           policy
#   upstream  none       model not served upstream                  -> refused         model_not_found
#   upstream  none                                                  -> want upstream   policy
#   auto (policy auto with no request mode, or request auto under policy auto or upstream):
#             model not local, served upstream                      -> want upstream   model
#             model not local                                       -> refused         model_not_found
#             model not served upstream                             -> local           offline_first
#             no local model fits the memory budget                 -> want upstream   memory
#             the local model failed to load                        -> want upstream   local_failed
#             device killed, critical, or new work paused           -> want upstream   thermal (or
#                                                                      background, memory: the cause)
#             heat paces the device (pace_tok_s known), and
#               the pace is slow (pace_slow(), with its hysteresis)  -> want upstream   thermal
#               or tokens ahead / pace > max_local_wait_s (> 0)     -> want upstream   thermal
#             prompt over the local context cap, no truncate        -> want upstream   context
#             local model still loading                             -> want upstream   loading
#             local queue full (overflow instead of 503)            -> want upstream   queue
#             otherwise                                             -> local           offline_first
#   auto, work embed (the model rows first, as above):
#             device killed, critical, or new work paused           -> want upstream   thermal (or ...)
#             local queue full                                      -> want upstream   queue
#             otherwise                                             -> local           offline_first
#     `local` (the generation model's load state) is not the encoder's: an embedding job opens its encoder
#     on the worker when it runs. A batch makes no tokens, so the pace rows say nothing of it; an input over
#     the context is the same model's refusal on either side, so the context row does not send it away.
#
#   "want upstream": upstream with that reason when the upstream is available; otherwise local with reason
#   breaker_open when the model is local, else refused upstream_unavailable. A wanted upstream falls back
#   to local if it fails before the first token (embed: before its answer), when the model is local and the
#   local model can load (embed: is installed).
def decide_route(i: RouteInputs) -> Decision:
    if i.policy == "local":
        if i.requested == "upstream":
            return Decision(None, "policy", refusal=NOT_ALLOWED)
        if not i.model_local:
            return Decision(None, "policy", refusal=NOT_FOUND)
        return Decision("local", "policy")
    if i.requested == "local":
        if not i.model_local:
            return Decision(None, "request", refusal=NOT_FOUND)
        return Decision("local", "request")
    if i.requested == "upstream":
        if not i.model_upstream:
            return Decision(None, "request", refusal=NOT_FOUND)
        if not i.upstream_available:
            return Decision(None, "request", refusal=UNAVAILABLE)
        return Decision("upstream", "request")
    if i.policy == "upstream" and i.requested is None:
        if not i.model_upstream:
            return (
                Decision("local", "policy") if i.model_local else Decision(None, "policy", refusal=NOT_FOUND)
            )
        return _want_upstream(i, "policy")
    return _auto(i)


def _auto(i: RouteInputs) -> Decision:
    if not i.model_local:
        if i.model_upstream:
            return _want_upstream(i, "model")
        return Decision(None, "model", refusal=NOT_FOUND)
    if not i.model_upstream:  # a local model the upstream does not serve: nothing to offload to
        return Decision("local", "offline_first")
    if i.work == "generate" and i.local == "no_memory":
        return _want_upstream(i, "memory")
    if i.work == "generate" and i.local == "failed":
        return _want_upstream(i, "local_failed")
    device = i.device
    if device is not None and (device.killed or device.paused or device.level == "critical"):
        return _want_upstream(i, _device_reason(device))
    if i.work == "embed":
        return _want_upstream(i, "queue") if i.queue_full else Decision("local", "offline_first")
    pace = device.pace_tok_s if device is not None else None
    if pace is not None and (
        i.pace_slow or 0 < i.max_local_wait_s < local_wait_s(i.local_tokens_ahead, pace)
    ):
        return _want_upstream(i, "thermal")
    if i.prompt_over_context and not i.truncate:
        return _want_upstream(i, "context")
    if i.local == "loading":
        return _want_upstream(i, "loading")
    if i.queue_full:
        return _want_upstream(i, "queue")
    return Decision("local", "offline_first")


def _device_reason(device: DeviceState) -> str:
    if device.lifecycle == "background":
        return "background"
    if device.cause == "memory":
        return "memory"
    return "thermal"


def _want_upstream(i: RouteInputs, reason: str) -> Decision:
    loads = i.work == "embed" or i.local not in ("no_memory", "failed", "closed")
    local_can_serve = i.model_local and loads
    if i.upstream_available:
        return Decision("upstream", reason, fallback=local_can_serve)
    if i.model_local:
        return Decision("local", "breaker_open")
    return Decision(None, reason, refusal=UNAVAILABLE)


def local_wait_s(tokens_ahead: int, pace_tok_s: float) -> float:
    """How long a new local job waits for its first token: the tokens ahead of it at the pace (its own
    prefill left out)."""
    return tokens_ahead / pace_tok_s if pace_tok_s > 0 else math.inf


# Leave the slow state only at this multiple of the floor. The pace follows the pace controller's budget,
# which is high-gain (0.4 core per C): without a band, the first fraction of a degree of cooling would bring
# work home, heat the device straight back under the floor, and every other request would change side.
HOME_FACTOR = 1.5


# The pace floor, with hysteresis (the router keeps `was_slow` from one request to the next):
#
#   floor 0 (off), or no thermal pace (cool enough that heat does not bind, or cost unknown)  -> not slow
#   pace < floor                                                                               -> slow
#   was slow and pace < HOME_FACTOR x floor                                                    -> slow
#   otherwise                                                                                  -> not slow
#
# Why a floor in tokens/s: it is what a user feels. Below silent reading speed (~5 tok/s: 240 words a
# minute at ~1.3 tokens a word) a streamed reply makes its reader wait for every word, and a whole reply
# takes its length / pace; above it, a paced device is still as good as a faster one for reading, so a
# fraction of the device's own full speed would offload replies nobody waits for on a fast device and keep
# unreadably slow ones on a slow device.
def pace_slow(was_slow: bool, device: DeviceState | None, min_tok_s: float) -> bool:
    if min_tok_s <= 0 or device is None or device.pace_tok_s is None:
        return False
    if device.pace_tok_s < min_tok_s:
        return True
    return was_slow and device.pace_tok_s < HOME_FACTOR * min_tok_s
