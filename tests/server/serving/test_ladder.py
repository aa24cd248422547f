"""The ladder across models: built from SIMMER_LADDER and the manifests, the memory tier it starts on, and
the rung one request runs on (place), table by table."""

from __future__ import annotations

import pytest

from governor.limits import Rung
from models.errors import InvalidParameter, ModelNotInstalled
from server.serving.catalog import CatalogEntry
from server.serving.ladder import build_ladder, model_rungs, parse_ladder, pick_start, place, shed_above
from server.serving.memory_plan import Estimate

MiB = 1 << 20


def variant(cpu: float, quality: float, weights: int) -> dict:
    return {
        "weights_bytes": weights,
        "speed": {"cpu_s_per_token": cpu},
        "quality": {"top1_agreement": quality},
    }


# Shaped like our conversions on this machine: exact q4 dearer than f32 in CPU, q4-a8 the nominal.
MANIFESTS = {
    "big": {
        "default_variant": "q4-a8",
        "variants": {
            "f32": variant(0.064, 1.0, 572 * MiB),
            "q4": variant(0.108, 1.0, 150 * MiB),
            "q4-a8": variant(0.032, 0.93, 146 * MiB),
        },
    },
    "small": {
        "default_variant": "q4-a8",
        "variants": {"q4": variant(0.05, 1.0, 60 * MiB), "q4-a8": variant(0.02, 0.95, 58 * MiB)},
    },
    "base": {"default_variant": "q4-a8", "variants": {"q4-a8": variant(0.03, 0.9, 100 * MiB)}},
    # a model whose re-encoded `fast` passed the quality floor: better top-1 than q4-a8 on its text, faster
    "coder": {
        "default_variant": "fast",
        "variants": {
            "q4": variant(0.12, 1.0, 900 * MiB),
            "q4-a8": variant(0.06, 0.96, 880 * MiB),
            "fast": variant(0.04, 0.97, 700 * MiB),
        },
    },
}


class Catalog:
    """The Catalog seam over plain entries."""

    def __init__(self, **chat: bool) -> None:
        self._entries = {
            m: CatalogEntry(
                m, None, manifest, can_chat=chat.get(m, True), tokenizer_key="bpe" if m != "base" else "spm"
            )
            for m, manifest in MANIFESTS.items()
        }

    def entries(self) -> list[CatalogEntry]:
        return list(self._entries.values())

    def get(self, model_id: str) -> CatalogEntry | None:
        return self._entries.get(model_id)

    def refresh(self) -> None:
        return None


def names(ladder: list[Rung]) -> list[str]:
    return [f"{r.model_id}/{r.variant}" for r in ladder]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("", []),
        ("a", [("a", None)]),
        ("a, b:q4 ,", [("a", None), ("b", "q4")]),
        ("gemma3-270m,smollm2-135m-instruct", [("gemma3-270m", None), ("smollm2-135m-instruct", None)]),
    ],
)
def test_parse_ladder(text, parsed):
    assert parse_ladder(text) == parsed


def test_parse_ladder_when_entry_names_no_model_then_invalid():
    with pytest.raises(InvalidParameter, match="names no model"):
        parse_ladder("a,:q4")


@pytest.mark.parametrize(
    ("spec", "preferred", "expected"),
    [
        # the nominal variant is the manifest's (q4-a8); dearer ones are not rungs
        ("big", None, ["big/q4-a8"]),
        ("big,small", None, ["big/q4-a8", "small/q4-a8"]),
        # SIMMER_VARIANT=q4: q4 is the nominal, q4-a8 (cheaper, smaller, worse) below it; f32 is cheaper in
        # CPU but bigger: no step down
        ("big,small", "q4", ["big/q4", "big/q4-a8", "small/q4", "small/q4-a8"]),
        # explicit rungs, as written
        ("big:q4,big:q4-a8,small", None, ["big/q4", "big/q4-a8", "small/q4-a8"]),
        # a model twice gives its rungs once
        ("small,small:q4-a8", None, ["small/q4-a8"]),
        # below the nominal by measured speed, not by top-1 (q4-a8's is lower here than fast's)
        ("coder", "q4", ["coder/q4", "coder/q4-a8", "coder/fast"]),
        ("coder", None, ["coder/fast"]),
    ],
)
def test_build_ladder(spec, preferred, expected):
    assert names(build_ladder(parse_ladder(spec), Catalog(), preferred_variant=preferred)) == expected


def test_build_ladder_when_model_not_installed_then_error_names_it():
    with pytest.raises(
        ModelNotInstalled, match=r"'gemma3-270m', which is not installed \(installed: base, big"
    ):
        build_ladder(parse_ladder("big,gemma3-270m"), Catalog())


def test_build_ladder_when_variant_missing_then_error_names_the_installed_ones():
    with pytest.raises(InvalidParameter, match="small has no variant 'f32'"):
        build_ladder(parse_ladder("small:f32"), Catalog())


def test_model_rungs_when_unmeasured_then_the_nominal_alone():
    entry = CatalogEntry(
        "m", None, {"default_variant": "q4", "variants": {"q4": {"weights_bytes": 7}}}, True, "k"
    )
    assert names(model_rungs(entry)) == ["m/q4"]


# -- the memory tier ----------------------------------------------------------------------------------------
LADDER = [
    Rung("big", "q4-a8", 0.03, 0.93, 300 * MiB),
    Rung("small", "q4-a8", 0.02, 0.95, 100 * MiB),
]


def cost(rung: Rung) -> Estimate:
    return Estimate(rung.bytes, 50 * MiB, 0, 50 * MiB)


@pytest.mark.parametrize(
    ("free_mib", "index", "fits"),
    [
        (None, 0, True),  # nothing known: the best rung
        (1000, 0, True),
        (400 + 99, 1, True),  # big needs 400 + headroom 100: one MiB short -> small
        (400 + 100, 0, True),
        (300, 1, True),
        (299, 1, False),  # nothing fits: the cheapest, and its load will be refused with the numbers
    ],
)
def test_pick_start(free_mib, index, fits):
    free = None if free_mib is None else free_mib * MiB
    plan = pick_start(LADDER, cost, free, 100 * MiB)
    assert (plan.index, plan.fits) == (index, fits)
    assert "start rung" in plan.describe(LADDER)


# -- one request's rung ----------------------------------------------------------------------------------
THREE = [
    Rung("big", "q4", 0.1, 1.0, 1),
    Rung("big", "q4-a8", 0.03, 0.93, 1),
    Rung("base", "q4-a8", 0.03, 0.9, 1),
    Rung("small", "q4-a8", 0.02, 0.95, 1),
]


def usable(*bad: str):
    return lambda model: model not in bad


@pytest.mark.parametrize(
    ("governed", "requested", "bad", "expected"),
    [
        # not on the ladder: the requested model, the governor's variant only if its rung is that model's
        (("big", "q4-a8"), "other", (), ("other", None)),
        (("other", "q4"), "other", (), ("other", "q4")),
        # no governor: the requested model's first rung
        (None, "big", (), ("big", "q4")),
        (None, "small", (), ("small", "q4-a8")),
        # the governor's rung
        (("big", "q4-a8"), "big", (), ("big", "q4-a8")),
        (("small", "q4-a8"), "big", (), ("small", "q4-a8")),
        # never above what the client asked for
        (("big", "q4"), "small", (), ("small", "q4-a8")),
        (("big", "q4"), "base", (), ("base", "q4-a8")),
        # a rung that cannot serve it is skipped, going down...
        (("base", "q4-a8"), "big", ("base",), ("small", "q4-a8")),
        # ...or, with none below, up (not above the requested model)
        (("small", "q4-a8"), "big", ("small",), ("base", "q4-a8")),
        (("small", "q4-a8"), "base", ("small", "base"), ("base", None)),
        # a governor rung of a model not on the ladder: the requested model's first rung
        (("stranger", "q4"), "big", (), ("big", "q4")),
    ],
)
def test_place(governed, requested, bad, expected):
    target = place(THREE, governed, requested, usable(*bad))
    assert (target.model_id, target.variant) == expected
    assert target.reason


# -- the idle bigger models once the rung moved down ---------------------------------------------------------
@pytest.mark.parametrize(
    ("rung", "busy", "wanted", "unload"),
    [
        # no rung, or a rung off the ladder: keep_alive decides
        (None, {"big": False}, (), []),
        ("stranger", {"big": False}, (), []),
        # the rung's model, models below it and models off the ladder stay
        ("big", {"big": False, "base": False, "small": False}, (), []),
        ("small", {"small": False, "other": False}, (), []),
        # above the rung and idle: unloaded, every one of them
        ("base", {"big": False, "base": False, "small": False}, (), ["big"]),
        ("small", {"big": False, "base": False, "small": False}, (), ["big", "base"]),
        # serving a reply (it moves down by itself), or wanted by a queued request: kept
        ("small", {"big": True, "base": False}, (), ["base"]),
        ("small", {"big": False, "base": False}, ("big",), ["base"]),
    ],
)
def test_shed_above(rung, busy, wanted, unload):
    assert shed_above(THREE, rung, busy, wanted) == unload
