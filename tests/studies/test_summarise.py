"""studies/summarise.py keeps every key of a report but the series, thins the series to samples it had, and
counts what the whole series said."""

from __future__ import annotations

import json

from studies.summarise import summarise


def test_summarise_when_series_then_other_keys_kept_and_series_thinned_to_its_own_samples(tmp_path) -> None:
    levels = ["fair"] * 40 + ["serious"] * 60 + ["fair"] * 20
    samples = [
        {"t": t, "temperature": 40.0 + (t == 77), "level": lv, "threads": 2, "tok_s": 1.0}
        for t, lv in enumerate(levels)
    ]
    report = {"benchmark": "sustained", "runs": {"governed": {"seconds_above_throttle": 3}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**report, "series": {"governed": samples}}))

    assert summarise(path, every=30) is not None
    got = json.loads(path.read_text())
    kept = got.pop("series")["governed"]
    summary = got.pop("series_summary")["governed"]
    assert got == report
    assert all(s in samples for s in kept)
    assert [s["t"] for s in kept] == [0, 30, 39, 40, 60, 77, 90, 99, 100, 119]
    assert summary["seconds_by"]["level"] == {"fair": 60, "serious": 60}
    assert summary["temperature"]["max"] == 41.0 and summary["t_of_peak_temperature"] == 77
    assert summarise(path, every=30) is None  # already summarised
