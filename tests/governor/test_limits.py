from dataclasses import replace

import pytest

from governor.limits import (
    DEFAULT_TABLE,
    ConfigCost,
    Limits,
    NoRungFits,
    Rung,
    build_ladder,
    choose_rung,
    config_costs,
    make_table,
    merge_cost,
    pick_config,
    pick_rung,
    pool_spin,
    resolve_limits,
    rungs_from_manifest,
)
from governor.policy import LoadRoom

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


# -- configurations: what a CPU budget buys ------------------------------------------------------------------
ONE = ConfigCost("v", 1, False, 0.016, 62.0)  # one thread: the cheapest per token, one core's speed
TWO_QUIET = ConfigCost("v", 2, False, 0.020, 90.0)
TWO_SPIN = ConfigCost("v", 2, True, 0.023, 110.0)  # spinning: fastest back to back, dearest per token
TABLE = [ONE, TWO_QUIET, TWO_SPIN]


@pytest.mark.parametrize(
    ("budget", "current", "chosen", "pace"),
    [
        (None, None, TWO_SPIN, None),  # no budget: the fastest
        (0.5, None, ONE, 0.5 / 0.016),  # binds every configuration: the cheapest per token
        (0.99, None, ONE, 0.99 / 0.016),  # one thread still makes 61.9 of its 62 tok/s
        (1.2, None, ONE, 1.2 / 0.016),  # two quiet threads 60 tok/s, one thread 62: one
        (1.5, None, TWO_QUIET, 1.5 / 0.020),  # two quiet threads 75: spinning never competes under a budget
        (1.5, ("v", 1), TWO_QUIET, 1.5 / 0.020),  # 75 >= 1.1 x 62: worth a new session
        (1.35, ("v", 1), ONE, 1.35 / 0.016),  # 67.5 < 1.1 x 62: the running one stays ...
        (1.35, ("v", 2), TWO_QUIET, 1.35 / 0.020),  # ... and so does two threads (62 is not within 5 %)
        (1.3, ("v", 2), ONE, 1.3 / 0.016),  # 62 within 5 % of 65 and cheaper: back to one thread
    ],
)
def test_pick_config_when_budget_then_most_tokens_within_it_and_cheapest_where_it_binds(
    budget, current, chosen, pace
):
    best, got_pace = pick_config(TABLE, budget, current)
    assert best == chosen
    assert got_pace == (None if pace is None else pytest.approx(pace))


@pytest.mark.parametrize(
    ("budget", "current", "chosen", "pace"),
    [
        (1.5, ("v", 1), ONE, 1.5 / 0.016),  # two threads would make 75 (>= 1.1 x 62): held all the same
        (0.5, ("v", 2), TWO_QUIET, 0.5 / 0.020),  # held, and paced to the budget at its own cost
        (0.5, ("w", 2), ONE, 0.5 / 0.016),  # nothing of that name runs here: nothing to hold
    ],
)
def test_pick_config_when_held_then_the_running_configuration_stays_within_the_budget(
    budget, current, chosen, pace
):
    best, got_pace = pick_config(TABLE, budget, current, hold=True)
    assert best == chosen
    assert got_pace == pytest.approx(pace)


@pytest.mark.parametrize(
    ("budget", "current", "chosen"),
    [
        (None, None, ONE),  # unbudgeted, the fastest would be TWO_SPIN: on battery the most tokens a CPU-s
        (1.5, None, ONE),  # a budget two quiet threads would use better: still the cheapest per token
        (None, ("v", 2), ONE),  # 62.5 against the running one's 50 tokens a CPU-s: worth a new session
    ],
)
def test_pick_config_when_frugal_then_most_tokens_per_cpu_second_and_no_spinning(budget, current, chosen):
    best, _ = pick_config(TABLE, budget, current, frugal=True)
    assert best == chosen


def test_pick_config_when_frugal_and_the_running_one_nearly_as_cheap_then_it_stays():
    # 57.1 tokens a CPU-s against one thread's 62.5: not within 5 %, but under 1.1x: no new session for it
    close = ConfigCost("v", 2, False, 0.0175, 90.0)
    assert pick_config([TABLE[0], close], None, ("v", 2), frugal=True)[0] == close
    assert pick_config([TABLE[0], TABLE[1]], None, ("v", 2), frugal=True)[0] == TABLE[0]  # 62.5 vs 50
    assert pick_config([TABLE[2]], None, None, frugal=True)[0] == TABLE[2]  # only a spinning one known


def test_resolve_limits_when_frugal_then_no_spinning_pool_and_the_cheapest_configuration():
    rung = Rung("m", "v", 0.016, 1.0, 1, threads=2, decode_tok_s=90.0)
    costs = TABLE
    plugged = resolve_limits("nominal", usable_cpus=2, ladder=[rung], costs=costs)
    assert (plugged.threads, plugged.spin) == (2, None)  # unpaced: the fastest, spinning as it likes
    on_battery = resolve_limits("nominal", usable_cpus=2, ladder=[rung], costs=costs, frugal=True)
    assert (on_battery.threads, on_battery.spin) == (1, False)


def test_pick_config_when_empty_then_value_error():
    with pytest.raises(ValueError):
        pick_config([], 1.0)


def test_config_costs_when_only_the_manifest_then_priors_from_its_one_measurement():
    rung = Rung("m", "q4-a8", 0.026, 0.93, 1, threads=2, decode_tok_s=60.0)
    one, two, three = config_costs(rung, 3)
    assert (one.threads, one.spinning, one.cpu_s_per_token) == (1, None, 0.026)
    assert one.tok_s == pytest.approx(1 / 0.026)  # one thread fills one core
    assert two.tok_s == 60.0 and three.tok_s == pytest.approx(90.0)
    assert config_costs(Rung("m", "x", 0.0, 1.0, 1), 2) == []  # unmeasured: nothing to pick from


def test_config_costs_when_measured_then_they_replace_the_prior_for_their_thread_count():
    rung = Rung("m", "q4-a8", 0.026, 0.93, 1, threads=2, decode_tok_s=60.0)
    measured = [
        ConfigCost("q4-a8", 1, False, 0.015, 66.0),
        ConfigCost("q4-a8", 2, True, 0.023, 85.0),  # only a spinning pool measured at 2 threads ...
        ConfigCost("q4-a8", 2, False, 0.0, 0.0),  # (nonsense is ignored)
        ConfigCost("other", 1, False, 0.001, 1000.0),
    ]
    costs = config_costs(rung, 2, measured)
    assert costs[0] == measured[0]
    assert costs[1] == measured[1]
    assert costs[2] == ConfigCost("q4-a8", 2, None, 0.026, 60.0)  # ... so the quiet one stays a prior
    unknown_speed = config_costs(rung, 2, [ConfigCost("q4-a8", 2, False, 0.02, 0.0)])
    assert unknown_speed[1] == ConfigCost("q4-a8", 2, False, 0.02, 60.0)
    # another model's variant of the same name is not this rung's; the rung's own model's is
    theirs = ConfigCost("q4-a8", 1, False, 0.001, 1000.0, model_id="gemma")
    assert config_costs(rung, 1, [theirs])[0].spinning is None  # the prior
    assert config_costs(rung, 1, [replace(theirs, model_id="m")]) == [replace(theirs, model_id="m")]


def test_merge_cost_when_same_key_then_replaced_else_added():
    a = ConfigCost("v", 1, False, 0.02, 50.0)
    table = merge_cost(merge_cost((), a), ConfigCost("v", 2, False, 0.03, 60.0))
    assert len(table) == 2
    newer = ConfigCost("v", 1, False, 0.018, 55.0)
    assert merge_cost(table, newer) == (table[1], newer)
    elsewhere = replace(newer, model_id="gemma")  # the same variant name of another model: its own entry
    assert merge_cost((newer,), elsewhere) == (newer, elsewhere)


def test_resolve_limits_when_thermal_pace_then_controller_replaces_the_rows_budget_and_threads():
    lad = ladder()
    # serious, thermal: 0.5 core buys one thread of q4-a8 (the serious rung), paced at 0.5 / 0.010
    s = resolve_limits("serious", usable_cpus=4, ladder=lad, start_rung=1, pace_cores=0.5, thermal=True)
    assert (s.threads, s.variant, s.cpu_budget_cores) == (1, "q4-a8", 0.5)
    assert s.tokens_per_second == pytest.approx(50.0)
    # 2.5 cores: more than one thread can use, so more threads (the row's one-thread cap is not thermal)
    big = resolve_limits("serious", usable_cpus=4, ladder=lad, start_rung=1, pace_cores=2.5, thermal=True)
    assert big.threads >= 3 and big.tokens_per_second == pytest.approx(250.0)
    # memory serious: the row's 0.75 core and one thread, unless the controller is tighter
    m = resolve_limits("serious", usable_cpus=4, ladder=lad, start_rung=1, pace_cores=2.5)
    assert (m.threads, m.cpu_budget_cores) == (1, 0.75)
    tight = resolve_limits("serious", usable_cpus=4, ladder=lad, start_rung=1, pace_cores=0.3)
    assert tight.cpu_budget_cores == 0.3
    # a cool device's controller sits at every core: no budget, no pace
    cool = resolve_limits("nominal", usable_cpus=4, ladder=lad, start_rung=1, pace_cores=4.0, thermal=True)
    assert (cool.cpu_budget_cores, cool.tokens_per_second, cool.threads) == (None, None, 4)
    # no ladder (cost unknown): the budget alone, for the worker's pace_delay
    bare = resolve_limits("serious", usable_cpus=2, pace_cores=0.6, thermal=True)
    assert (bare.cpu_budget_cores, bare.tokens_per_second, bare.threads) == (0.6, None, 2)


def test_resolve_limits_when_measured_costs_then_the_budget_buys_the_cheapest_configuration():
    lad = build_ladder([("m", "q4-a8", 0.026, 0.93, 1, 2, 60.0)])
    costs = [ConfigCost("q4-a8", 1, False, 0.015, 66.0), ConfigCost("q4-a8", 2, True, 0.023, 85.0)]
    paced = resolve_limits("serious", usable_cpus=2, ladder=lad, pace_cores=0.9, thermal=True, costs=costs)
    assert paced.threads == 1 and paced.tokens_per_second == pytest.approx(0.9 / 0.015)
    fast = resolve_limits("nominal", usable_cpus=2, ladder=lad, costs=costs)
    assert fast.threads == 2 and fast.tokens_per_second is None  # unpaced: the engine spins (auto)


def test_resolve_limits_when_explicit_row_pace_then_the_slower_of_it_and_the_budget_pace():
    table = make_table({"serious": {"tokens_per_second": 20.0}})
    lad = ladder()
    slow = resolve_limits("serious", usable_cpus=2, table=table, ladder=lad, start_rung=1)
    assert slow.tokens_per_second == 20.0
    paced = resolve_limits(
        "serious", usable_cpus=2, table=table, ladder=lad, start_rung=1, pace_cores=0.1, thermal=True
    )
    assert paced.tokens_per_second == pytest.approx(10.0)


def test_config_costs_when_fewer_threads_measured_dearer_than_the_manifest_then_priors_follow():
    # the manifest came from a quiet machine (26 ms); here one thread measures 70 ms: two threads cannot
    # be assumed cheaper than that, so a budget never moves to an unmeasured pool on the manifest's word
    rung = Rung("m", "q4-a8", 0.026, 0.93, 1, threads=2, decode_tok_s=60.0)
    one, two = config_costs(rung, 2, [ConfigCost("q4-a8", 1, False, 0.07, 14.0)])
    assert two == ConfigCost("q4-a8", 2, None, 0.07, pytest.approx(2 / 0.07))
    assert pick_config([one, two], 0.5)[0] == one


# Which rung each level runs on (DEFAULT_TABLE's ladder rules), table by table.
NOMINAL_PAIR = build_ladder([("big", "q4-a8", 0.010, 0.95, 200), ("small", "q4-a8", 0.005, 0.80, 90)])
Q4_PAIR = [
    Rung("big", "q4", 0.014, 0.98, 230),
    Rung("big", "q4-a8", 0.010, 0.95, 200),
    Rung("small", "q4", 0.007, 0.85, 95),
    Rung("small", "q4-a8", 0.005, 0.80, 90),
]
ONE = [Rung("big", "q4-a8", 0.010, 0.95, 200)]


@pytest.mark.parametrize(
    ("lad", "start", "level", "rung"),
    [
        # the nominal q4-a8 ladder: one rung per model; serious and critical both reach the smaller model
        (NOMINAL_PAIR, 0, "nominal", ("big", "q4-a8")),
        (NOMINAL_PAIR, 0, "fair", ("big", "q4-a8")),
        (NOMINAL_PAIR, 0, "serious", ("small", "q4-a8")),
        (NOMINAL_PAIR, 0, "critical", ("small", "q4-a8")),
        # SIMMER_VARIANT=q4: serious steps a variant down, critical to the cheapest rung (the other model)
        (Q4_PAIR, 0, "nominal", ("big", "q4")),
        (Q4_PAIR, 0, "fair", ("big", "q4")),
        (Q4_PAIR, 0, "serious", ("big", "q4-a8")),
        (Q4_PAIR, 0, "critical", ("small", "q4-a8")),
        # a memory tier that started lower: the same steps from there
        (Q4_PAIR, 1, "nominal", ("big", "q4-a8")),
        (Q4_PAIR, 1, "serious", ("small", "q4")),
        (Q4_PAIR, 1, "critical", ("small", "q4-a8")),
        (Q4_PAIR, 3, "serious", ("small", "q4-a8")),
        # one rung: nowhere to go
        (ONE, 0, "serious", ("big", "q4-a8")),
        (ONE, 0, "critical", ("big", "q4-a8")),
    ],
)
def test_resolve_limits_when_level_then_the_table_says_which_rung(lad, start, level, rung):
    limits = resolve_limits(level, usable_cpus=2, ladder=lad, start_rung=start)
    assert (limits.model_id, limits.variant) == rung


def test_default_table_when_critical_then_steps_further_than_serious():
    assert DEFAULT_TABLE["nominal"].rung_step == DEFAULT_TABLE["fair"].rung_step == 0
    assert DEFAULT_TABLE["serious"].rung_step == 1
    assert DEFAULT_TABLE["critical"].rung_step > len(Q4_PAIR)


@pytest.mark.parametrize(
    ("budget", "pace", "spin"),
    [
        (None, None, None),  # unpaced: the engine's setting (auto spins)
        (0.9, None, False),  # a budget without a known cost: the gate idles by pace_delay
        (0.9, 60.0, False),  # the pace controller's budget and its pace
        (None, 20.0, False),  # a row's own tokens/s pace
    ],
)
def test_pool_spin_when_paced_then_no_spinning_else_the_engines_setting(budget, pace, spin):
    assert pool_spin(budget, pace) is spin


def test_resolve_limits_when_the_governor_paces_then_the_pools_do_not_spin():
    lad = build_ladder([("m", "q4-a8", 0.026, 0.93, 1, 2, 60.0)])
    costs = [ConfigCost("q4-a8", 1, False, 0.015, 66.0), ConfigCost("q4-a8", 2, True, 0.023, 85.0)]
    paced = resolve_limits("serious", usable_cpus=2, ladder=lad, pace_cores=0.9, thermal=True, costs=costs)
    assert paced.tokens_per_second is not None and paced.spin is False
    # no cost known (no ladder): the budget alone, the gate idles by pace_delay: no spinning either
    bare = resolve_limits("serious", usable_cpus=2, pace_cores=0.6, thermal=True)
    assert (bare.tokens_per_second, bare.spin) == (None, False)
    # the level table's memory serious (its own 0.75 core budget)
    assert resolve_limits("serious", usable_cpus=2, ladder=lad).spin is False
    # unpaced: nominal, a cool device whose controller allows every core, a governor that does not enforce
    # (pace_cores None, level nominal): the engine's own setting
    assert resolve_limits("nominal", usable_cpus=2, ladder=lad, costs=costs).spin is None
    cool = resolve_limits("nominal", usable_cpus=2, ladder=lad, pace_cores=2.0, thermal=True)
    assert cool.spin is None
    # fair by the level table (pace control off): fewer threads, no pace, so the setting stands
    assert resolve_limits("fair", usable_cpus=2, ladder=lad).spin is None


@pytest.mark.parametrize(
    ("cpu_s", "tok_s", "two_threads_tok_s", "unpaced_threads"),
    [
        (0.0579, 31.21, 31.21, 2),  # Gemma 3 converted on a quiet machine: 1.8 of 2 cores busy, kept
        (0.026, 50.0, 50.0, 2),  # 1.3 of 2 busy: a real measurement, kept
        (0.062, 16.06, 2 / 0.062, 2),  # Gemma 3 converted at machine load 5+: 1.0 of 2 busy, starved
        (0.026, 40.0, 2 / 0.026, 2),  # 1.04 of 2 busy: starved
    ],
)
def test_config_costs_when_the_manifest_was_measured_starved_then_its_speed_is_not_the_threads(
    cpu_s, tok_s, two_threads_tok_s, unpaced_threads
):
    rung = Rung("m", "q4-a8", cpu_s, 0.9, 1, threads=2, decode_tok_s=tok_s)
    one, two = config_costs(rung, 2)
    assert one.tok_s == pytest.approx(1 / cpu_s)  # one thread fills one core
    assert two.tok_s == pytest.approx(two_threads_tok_s)
    assert pick_config([one, two], None)[0].threads == unpaced_threads
    assert pick_config([one, two], 0.5)[0].threads == 1  # under a budget a pool never makes a token cheaper


# -- choose_rung: a rung whose model must load counts its load's heat first ----------------------------------
THREE = [
    Rung("big", "q4", 0.02, 0.99, 300),
    Rung("mid", "q4", 0.01, 0.95, 150),
    Rung("small", "q4", 0.005, 0.9, 90),
]
COOL = LoadRoom(below_throttle=True, room_c=9.0)  # 38 C on a heatwave phone: 9 C below critical's 47 C
HOT = LoadRoom(below_throttle=False, room_c=3.0)  # 44 C: past T_throttle 43 C
RISES = {"big": 10.0, "mid": 3.5, "small": 1.0}  # as measured at earlier loads


@pytest.mark.parametrize(
    ("index", "loaded", "room", "rises", "expected"),
    [
        (1, {"big"}, None, RISES, 1),  # no room known (no sensor, memory pressure): the level's rung
        (1, None, HOT, RISES, 1),  # what is loaded is not known: the level's rung
        (1, {"mid", "big"}, HOT, RISES, 1),  # the level's rung is loaded
        (0, set(), COOL, {}, 0),  # nothing measured: a cool device loads the level's rung
        (0, set(), COOL, RISES, 1),  # the big load would heat past critical: the best rung whose load fits
        (0, set(), LoadRoom(True, 0.5), RISES, 2),  # no load fits, nothing loaded: the cheapest
        (0, set(), HOT, RISES, 2),  # past T_throttle, nothing loaded: the cheapest
        (1, {"big"}, HOT, RISES, 0),  # past T_throttle: the loaded bigger one goes on, paced
        (1, {"big"}, COOL, RISES, 1),  # room for the middle one's load
        (1, {"big"}, LoadRoom(True, 3.0), RISES, 2),  # too little room for it, enough for the small one's
        (0, {"small", "mid"}, HOT, RISES, 1),  # below first: the nearest loaded cheaper one
        (1, {"big", "small"}, HOT, RISES, 2),  # below first, even where one above is as near
        (2, {"big", "mid"}, HOT, RISES, 1),  # the bottom is not loaded: the nearest loaded above
        (1, {"other"}, HOT, RISES, 2),  # only models off the ladder are loaded: the cheapest loads
    ],
)
def test_choose_rung_when_a_load_must_fit_then_the_rule_table_says(index, loaded, room, rises, expected):
    assert choose_rung(THREE, index, loaded, room, rises) == expected


def test_resolve_limits_when_no_room_for_the_load_then_the_rung_is_the_loaded_one_and_says_so():
    free = resolve_limits("serious", usable_cpus=2, ladder=THREE, loaded={"big"}, room=COOL, rises=RISES)
    held = resolve_limits("serious", usable_cpus=2, ladder=THREE, loaded={"big"}, room=HOT, rises=RISES)
    assert (free.model_id, free.rung_held) == ("mid", False)
    assert (held.model_id, held.rung_held) == ("big", True)
    assert held.cpu_budget_cores == free.cpu_budget_cores  # the same budget paces the bigger model
    both = resolve_limits("serious", usable_cpus=2, ladder=THREE, loaded={"big", "mid"}, room=HOT)
    assert (both.model_id, both.rung_held) == ("mid", False)
