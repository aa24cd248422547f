"""Where a request is served: a pure function from what is known now to a side and a reason.

No clock, no I/O: the router (router.py) gathers the inputs (settings, the request, the breaker, the
governor's state through a read-only seam, the worker's state) and acts on the decision. Tests drive it
table by table (tests/server/routing/test_policy.py), like governor/policy.py's decide().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["local", "auto", "upstream"]
Side = Literal["local", "upstream"]
# The local model: ready, loading, no variant fits the memory budget, failed to load otherwise, shut down.
LocalState = Literal["ready", "loading", "no_memory", "failed", "closed"]
MODES: tuple[Mode, ...] = ("local", "auto", "upstream")

# Refusals, as error codes of the server's vocabulary (server/errors.py).
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
#             prompt over the local context cap, no truncate        -> want upstream   context
#             local model still loading                             -> want upstream   loading
#             local queue full (overflow instead of 503)            -> want upstream   queue
#             otherwise                                             -> local           offline_first
#
#   "want upstream": upstream with that reason when the upstream is available; otherwise local with reason
#   breaker_open when the model is local, else refused upstream_unavailable. A wanted upstream falls back
#   to local if it fails before the first token, when the model is local and the local model can load.
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
    if i.local == "no_memory":
        return _want_upstream(i, "memory")
    if i.local == "failed":
        return _want_upstream(i, "local_failed")
    device = i.device
    if device is not None and (device.killed or device.paused or device.level == "critical"):
        return _want_upstream(i, _device_reason(device))
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
    local_can_serve = i.model_local and i.local not in ("no_memory", "failed", "closed")
    if i.upstream_available:
        return Decision("upstream", reason, fallback=local_can_serve)
    if i.model_local:
        return Decision("local", "breaker_open")
    return Decision(None, reason, refusal=UNAVAILABLE)
