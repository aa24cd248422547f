"""The governor's ladder across models: built from SIMMER_LADDER and the manifests, the memory tier it starts
on, and the rung one request runs on (`place`).

A ladder is a list of rungs (model, variant), best first. `SIMMER_LADDER=gemma3-270m,smollm2-135m-instruct`
gives each model's nominal variant (SIMMER_VARIANT where the model has it, else the manifest's default,
q4-a8 for our conversions) followed by its measured variants that are cheaper in CPU, no bigger and no
better, then the next model's. An entry `model:variant` is that one rung. Without SIMMER_LADDER the ladder
is the default model's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from governor.limits import Rung, rungs_from_manifest
from models.errors import InvalidParameter, ModelNotInstalled
from server.serving.catalog import Catalog, CatalogEntry
from server.serving.memory_plan import Estimate, mib

log = logging.getLogger("simmer.governor")


def parse_ladder(text: str | None) -> list[tuple[str, str | None]]:
    """ "a,b:q4" -> [("a", None), ("b", "q4")]."""
    out: list[tuple[str, str | None]] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        model, _, variant = item.partition(":")
        if not model.strip():
            raise InvalidParameter(f"SIMMER_LADDER: {item!r} names no model", param="ladder")
        out.append((model.strip(), variant.strip() or None))
    return out


def _rung(entry: CatalogEntry, variant: str) -> Rung:
    measured = [Rung(*r) for r in rungs_from_manifest(entry.id, entry.manifest.get("variants") or {})]
    own = [r for r in measured if r.variant == variant]
    if own:
        return own[0]
    weights = int(((entry.manifest.get("variants") or {}).get(variant) or {}).get("weights_bytes") or 0)
    return Rung(model_id=entry.id, variant=variant, cpu_s_per_token=0.0, quality_top1=1.0, bytes=weights)


def model_rungs(entry: CatalogEntry, preferred_variant: str | None = None) -> list[Rung]:
    """The model's nominal variant, then its measured variants that are cheaper in CPU per token, no
    bigger and no better (each step down saves CPU and costs no memory), ordered by measured speed,
    cheapest last."""
    nominal = preferred_variant if preferred_variant in entry.variants else entry.default_variant
    if nominal is None:
        raise ModelNotInstalled(f"{entry.id}: the manifest lists no variants")
    top = _rung(entry, nominal)
    measured = [Rung(*r) for r in rungs_from_manifest(entry.id, entry.manifest.get("variants") or {})]
    below = [
        r
        for r in measured
        if r.variant != nominal
        and top.cpu_s_per_token > 0
        and r.cpu_s_per_token < top.cpu_s_per_token
        and r.bytes <= top.bytes
        and r.quality_top1 <= top.quality_top1
    ]
    # by measured speed: every installed variant is within the quality floor (the converter installs no
    # re-encoded one beyond it), so each step down is simply the next cheaper one
    below.sort(key=lambda r: -r.cpu_s_per_token)
    return [top, *below]


def build_ladder(
    spec: Sequence[tuple[str, str | None]], catalog: Catalog, *, preferred_variant: str | None = None
) -> list[Rung]:
    """Validate SIMMER_LADDER against what is installed (a clear error naming what is missing) and expand
    it into rungs."""
    rungs: list[Rung] = []
    for model_id, variant in spec:
        entry = catalog.get(model_id)
        if entry is None:
            installed = ", ".join(sorted(e.id for e in catalog.entries())) or "none"
            raise ModelNotInstalled(
                f"SIMMER_LADDER names {model_id!r}, which is not installed (installed: {installed}). "
                f"Run `simmer pull {model_id}` or take it out of the ladder."
            )
        if variant is not None:
            if variant not in entry.variants:
                raise InvalidParameter(
                    f"SIMMER_LADDER: {model_id} has no variant {variant!r} "
                    f"(installed: {', '.join(entry.variants)})",
                    param="ladder",
                )
            new = [_rung(entry, variant)]
        else:
            new = model_rungs(entry, preferred_variant)
        rungs += [r for r in new if (r.model_id, r.variant) not in {(x.model_id, x.variant) for x in rungs}]
    return rungs


def describe(ladder: Sequence[Rung]) -> str:
    return " > ".join(f"{r.model_id}/{r.variant}" for r in ladder) or "(none)"


# -- the memory tier at start -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StartPlan:
    index: int
    need_bytes: int | None  # of the start rung
    free_bytes: int | None
    headroom_bytes: int
    fits: bool  # False: no rung fits; the start rung is the cheapest and loading it will be refused

    def describe(self, ladder: Sequence[Rung]) -> str:
        rung = ladder[self.index] if ladder else None
        name = f"{rung.model_id}/{rung.variant}" if rung else "(none)"
        if self.free_bytes is None:
            return f"start rung {name} (memory budget unknown)"
        verdict = "fits" if self.fits else "does NOT fit (nothing does)"
        return (
            f"start rung {name} {verdict}: needs ~{mib(self.need_bytes)} + headroom "
            f"{mib(self.headroom_bytes)} of {mib(self.free_bytes)} free"
        )


def pick_start(
    ladder: Sequence[Rung], cost: Callable[[Rung], Estimate], free_bytes: int | None, headroom_bytes: int
) -> StartPlan:
    """The best rung whose estimate plus headroom fits what is free (seed 001, section 2.1: the model size
    by the device's memory tier)."""
    if not ladder:
        return StartPlan(0, None, free_bytes, headroom_bytes, True)
    if free_bytes is None:
        return StartPlan(0, cost(ladder[0]).total, None, headroom_bytes, True)
    for i, rung in enumerate(ladder):
        need = cost(rung).total
        if need + headroom_bytes <= free_bytes:
            return StartPlan(i, need, free_bytes, headroom_bytes, True)
    last = len(ladder) - 1
    return StartPlan(last, cost(ladder[last]).total, free_bytes, headroom_bytes, False)


# -- one request's rung ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    model_id: str
    variant: str | None  # None: the engine's own choice (its nominal, or what it runs)
    reason: str


# The rule table, for one request (the governor's rung moves; the request's needs do not):
#
#   requested model not on the ladder          -> that model; the governor's variant when the governor's rung
#                                                 is of that model, else the model's own
#   no governor rung known (no governor)       -> the requested model's first usable rung
#   otherwise: from the governor's rung, but never above the requested model's first rung (a client who
#   asks for the smaller model never gets the bigger one):
#     that rung or the first usable one below  -> it
#     none below is usable                      -> the nearest usable one above (not above the requested)
#   no usable rung at all                       -> the requested model (it refuses: model_not_chat)
# Usable: a chat request needs a chat template; a request with logit_bias needs the requested model's
# vocabulary (its token ids mean nothing in another).
def place(
    ladder: Sequence[Rung],
    governed: tuple[str | None, str | None] | None,
    requested: str,
    usable: Callable[[str], bool],
) -> Target:
    own = [i for i, r in enumerate(ladder) if r.model_id == requested]
    if not own:
        same = governed is not None and governed[0] == requested
        return Target(requested, governed[1] if same and governed else None, "not on the ladder")
    floor = own[0]
    start = floor
    if governed is not None and governed[0] is not None:
        at = [i for i, r in enumerate(ladder) if (r.model_id, r.variant) == governed]
        at = at or [i for i, r in enumerate(ladder) if r.model_id == governed[0]]
        if at:
            start = max(at[0], floor)
    for i in range(start, len(ladder)):
        if usable(ladder[i].model_id):
            variant = governed[1] if governed and i == start and ladder[i].model_id == governed[0] else None
            return Target(ladder[i].model_id, variant or ladder[i].variant, _why(i, start, floor))
    for i in range(start - 1, floor - 1, -1):
        if usable(ladder[i].model_id):
            return Target(ladder[i].model_id, ladder[i].variant, "the governor's rung cannot serve it: above")
    return Target(requested, None, "no rung can serve it")


def _why(i: int, start: int, floor: int) -> str:
    if i != start:
        return "skipped rungs that cannot serve it"
    return "the governor's rung" if start != floor else "the requested model's rung"


# -- the idle bigger models once the rung moved down -------------------------------------------------------
# The rule table, for each loaded model (what the worker unloads; the governor only moved its rung):
#
#   no governor rung, or its model is not on the ladder       -> keep (keep_alive decides)
#   memory to spare (no memory pressure, and the budget keeps
#   its headroom with every loaded model in it)                -> keep (keep_alive decides): idle, the bigger
#                                                                 model costs no heat, and the rung's step
#                                                                 back up is a swap, not a load
#   the model is the rung's, below it, or not on the ladder   -> keep (keep_alive decides)
#   above the rung's model on the ladder:
#     serving a reply (busy)                                   -> keep: the reply moves down by a handover,
#                                                                 and the model is looked at again after it
#     a queued request is placed on it (only it can serve it)  -> keep, for that request
#     idle                                                     -> unload now: the device is hot or short of
#                                                                 memory, so the bigger model's memory goes
#                                                                 back at once, not when its keep_alive ends
# A request that names the bigger model is placed on the rung (never above it) and keeps nothing loaded.
def shed_above(
    ladder: Sequence[Rung],
    rung_model: str | None,
    busy: Mapping[str, bool],
    wanted: Collection[str],
    *,
    spare: bool = False,
) -> list[str]:
    """The loaded models (`busy`: model -> serving now) to unload now that the governor's rung is
    `rung_model`'s; `wanted`: the models queued requests are placed on; `spare`: memory to spare."""
    if spare:
        return []
    first: dict[str, int] = {}
    for i, rung in enumerate(ladder):
        first.setdefault(rung.model_id, i)
    if rung_model not in first:
        return []
    floor = first[rung_model]
    return [
        model
        for model, serving in busy.items()
        if model in first and first[model] < floor and not serving and model not in wanted
    ]


# -- a stand-in while the placed model loads ----------------------------------------------------------------
# The rule table, for a job placed on a model that is not loaded yet (first match; the caller has already
# left out the jobs that wait for their model: SIMMER_COLD_START=wait, or the request's wait_for_model):
#
#   the placed model is not on the ladder                        -> none: the job waits for its load
#   a rung below the placed model's first rung, of another
#   model, usable for the job and ready (loaded, or loading
#   ahead of the placed model: the stand-in loaded at start)     -> the first such rung stands in: the reply
#                                                                   starts there and hands over once the
#                                                                   placed model is loaded
#   otherwise                                                    -> none: the job waits
# Below only: a reply never starts on a bigger model than the one it was placed on (the governor's rung or
# the client's choice caps it), and a stand-in must cost less to run than the wait it saves.
def stand_in(
    ladder: Sequence[Rung], placed: Target, ready: Callable[[str], bool], usable: Callable[[str], bool]
) -> Target | None:
    own = [i for i, r in enumerate(ladder) if r.model_id == placed.model_id]
    if not own:
        return None
    for rung in ladder[own[0] + 1 :]:
        if rung.model_id != placed.model_id and usable(rung.model_id) and ready(rung.model_id):
            return Target(rung.model_id, rung.variant, f"stands in while {placed.model_id} loads")
    return None


def start_stand_in(ladder: Sequence[Rung], start: str | None, usable: Callable[[str], bool]) -> str | None:
    """The model to load before `start` at the server's start, so that a first request finds a stand-in:
    the cheapest usable rung of another model below it (loading it takes a fraction of the big one's time).
    None when `start` is not on the ladder or nothing below it is of another model."""
    own = [i for i, r in enumerate(ladder) if r.model_id == start]
    if not own:
        return None
    below = [r.model_id for r in ladder[own[0] + 1 :] if r.model_id != start and usable(r.model_id)]
    return below[-1] if below else None
