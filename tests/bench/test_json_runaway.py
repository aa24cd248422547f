"""bench/json_runaway.py on the tiny model: the report adds up (every reply is a stop that parses and
validates, or a cut one), and what a cut reply was writing is told apart."""

from __future__ import annotations

import json

from bench.json_runaway import MODES, cut_kind, run


def test_json_runaway_when_run_then_every_stop_parses_and_the_counts_add_up(tiny_model_dir) -> None:
    report = run(tiny_model_dir, seeds=3, max_tokens=24, threads=1, variant="q4")
    json.dumps(report)  # it prints as JSON
    for mode in MODES:
        got = report[mode]
        assert got["stop"] + got["length"] == 3 and not got["other_finish"]
        assert got["stop_valid"] == got["stop"] and got["stop_invalid"] == []
        assert sum(got["length_cut_in"].values()) == got["length"]


def test_cut_kind_when_digits_string_or_other_then_named() -> None:
    assert cut_kind('{"name": "Oslo", "population": 1234567890123') == "digits"
    assert cut_kind('{"name": "Oslo is a city wh') == "string"
    assert cut_kind('{"name": "Oslo", "a": [{"b": [') == "other"
