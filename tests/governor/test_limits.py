import pytest

from governor.limits import (
    DEFAULT_TABLE,
    Limits,
    NoRungFits,
    build_ladder,
    make_table,
    pick_rung,
    resolve_limits,
    rungs_from_manifest,
)

MANIFEST = {
    "q4": {
        "speed": {"decode_tok_s": 140.0, "cpu_s_per_token": 0.014},
        "quality": {"top1_agreement": 0.98, "max_logit_error": 0.03},
        "memory": {"total_bytes": 230_000_000},
    },
    "q4-a8": {
        "speed": {"decode_tok_s": 190.0, "cpu_s_per_token": 0.010},
        "quality": {"top1_agreement": 0.95, "max_logit_error": 0.08},
        "memory": {"total_bytes": 200_000_000},
    },
    "f32": {
        "speed": {"decode_tok_s": 60.0, "cpu_s_per_token": 0.033},
        "quality": {"top1_agreement": 1.0, "max_logit_error": 0.0},
        "memory": {"total_bytes": 600_000_000},
    },
    "q8": {  # as good as q4 or worse and dearer: never worth stepping down to
        "speed": {"cpu_s_per_token": 0.020},
        "quality": {"top1_agreement": 0.97},
        "memory": {"total_bytes": 330_000_000},
    },
    "unmeasured": {"speed": {}},
}


def ladder():
    rungs = rungs_from_manifest("smollm2-360m", MANIFEST)
    rungs.append(("smollm2-135m", "q4", 0.005, 0.80, 90_000_000))  # a smaller installed model
    return build_ladder(rungs)


def test_build_ladder_when_manifest_then_best_quality_first_and_each_rung_cheaper():
    names = [(r.model_id, r.variant) for r in ladder()]
    assert names == [
        ("smollm2-360m", "f32"),
        ("smollm2-360m", "q4"),
        ("smollm2-360m", "q4-a8"),
        ("smollm2-135m", "q4"),
    ]
    costs = [r.cpu_s_per_token for r in ladder()]
    assert costs == sorted(costs, reverse=True)


def test_build_ladder_when_equal_quality_then_cheaper_first():
    rungs = [("m", "f32", 0.03, 1.0, 600), ("m", "q4", 0.014, 1.0, 230)]
    assert [r.variant for r in build_ladder(rungs)] == ["q4"]


@pytest.mark.parametrize(
    ("budget", "index"),
    [(10**9, 0), (500_000_000, 1), (210_000_000, 2), (100_000_000, 3)],
)
def test_pick_rung_when_budget_then_highest_rung_that_fits(budget, index):
    assert pick_rung(ladder(), budget) == index


def test_pick_rung_when_estimate_given_then_it_decides_fit():
    # weights + KV for the context + runtime overhead
    def estimate(rung):
        return rung.bytes + 150_000_000

    assert pick_rung(ladder(), 500_000_000, estimate) == 1


def test_pick_rung_when_nothing_fits_then_clear_error():
    with pytest.raises(NoRungFits, match=r"memory budget of 50 MiB.*smollm2-135m/q4 needs 86 MiB") as err:
        pick_rung(ladder(), 50 * 2**20)
    assert err.value.code == "insufficient_memory"
    with pytest.raises(NoRungFits, match="no variants installed"):
        pick_rung([], 10**9)


def test_resolve_limits_when_each_level_then_levers_tighten():
    lad = ladder()
    nominal = resolve_limits("nominal", usable_cpus=4, ladder=lad, start_rung=1)
    fair = resolve_limits("fair", usable_cpus=4, ladder=lad, start_rung=1)
    serious = resolve_limits("serious", usable_cpus=4, ladder=lad, start_rung=1)
    critical = resolve_limits("critical", usable_cpus=4, ladder=lad, start_rung=1)
    assert (nominal.threads, nominal.variant, nominal.tokens_per_second) == (4, "q4", None)
    assert not (nominal.pause_new or nominal.pause_running)
    assert (fair.threads, fair.variant) == (2, "q4")
    assert (serious.threads, serious.variant, serious.model_id) == (1, "q4-a8", "smollm2-360m")
    assert serious.tokens_per_second == pytest.approx(0.75 / 0.010)  # 0.75 busy core at 10 ms CPU/token
    assert serious.context_cap == 1024 and serious.max_tokens == 512
    assert critical.pause_new and critical.pause_running


def test_resolve_limits_when_ladder_end_reached_then_clamped_to_last_rung():
    lad = ladder()
    assert resolve_limits("critical", usable_cpus=2, ladder=lad, start_rung=3).variant == "q4"
    bare = resolve_limits("serious", usable_cpus=2)
    assert bare.variant is None and bare.tokens_per_second is None and bare.cpu_budget_cores == 0.75


def test_pace_delay_when_cpu_budget_then_idle_to_keep_average_busy_cores():
    assert Limits(threads=1, cpu_budget_cores=0.75).pace_delay(0.03) == pytest.approx(0.01)
    assert Limits(threads=2, cpu_budget_cores=0.5).pace_delay(0.01) == pytest.approx(0.03)
    assert Limits(threads=2).pace_delay(0.01) == 0.0


def test_make_table_when_overrides_then_only_those_fields_change():
    table = make_table({"serious": {"max_tokens": 128}, "fair": {"thread_fraction": 0.25}})
    assert table["serious"].max_tokens == 128
    assert table["serious"].context_cap == DEFAULT_TABLE["serious"].context_cap
    assert resolve_limits("fair", usable_cpus=8, table=table).threads == 2
    assert DEFAULT_TABLE["serious"].max_tokens == 512
    with pytest.raises(ValueError, match="unknown level"):
        make_table({"meltdown": {}})
