"""The soak benchmark: its growth arithmetic, and one short run against the tiny real model through
`simmer bench soak` (the JSON it prints and writes)."""

from __future__ import annotations

import json

import pytest

from bench.cli import cli_bench
from bench.soak import growth
from server.settings import Settings


def samples(rss: list[float], every: float = 10.0) -> list[dict[str, float]]:
    return [{"t_s": (i + 1) * every, "rss_mib": r} for i, r in enumerate(rss)]


def test_growth_when_flat_after_warmup_then_zero_and_no_slope():
    # a fast rise during warm-up (the first 30 s) does not count
    result = growth(samples([100, 150, 190, 200, 200, 201, 199, 200, 200, 200, 200, 200]), warmup_s=35)
    assert result["growth_after_warmup_percent"] == 0.0
    assert abs(result["slope_after_warmup_mib_per_min"]) < 0.2


def test_growth_when_rising_after_warmup_then_percent_from_medians_and_slope():
    rss = [200 + i for i in range(19)]  # 1 MiB per 10 s sample: 6 MiB/min
    result = growth(samples(rss), warmup_s=0)
    # medians of the first minute (t 10..50 s: 200..204) and of the last minute (t 140..190 s: 213..218)
    assert result["rss_after_warmup_mib"] == 202 and result["rss_end_mib"] == 215.5
    assert result["growth_after_warmup_percent"] == round(13.5 / 202 * 100, 2)
    assert result["slope_after_warmup_mib_per_min"] == pytest.approx(6.0)


def test_growth_when_one_transient_spike_then_median_ignores_it():
    result = growth(samples([200, 200, 200, 200, 200, 200, 260, 200, 200, 200, 200, 200]), warmup_s=0)
    assert result["growth_after_warmup_percent"] == 0.0


def test_growth_when_run_shorter_than_warmup_then_says_so():
    assert growth(samples([100, 110]), warmup_s=60)["growth_after_warmup_percent"] is None


@pytest.mark.slow
def test_bench_soak_when_short_run_on_tiny_model_then_report_with_outcomes_and_no_errors(
    tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "soak.json"
    argv = ["soak", "--minutes", "0.3", "--model-dir", str(tiny_model_dir), "--sample-s", "1"]
    argv += ["--warmup-s", "5", "--json", str(out)]
    assert cli_bench(argv, Settings(home=tmp_path, context_length=256)) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report and report["benchmark"] == "soak"
    assert report["errors"] == 0, report["error_examples"]
    outcomes = report["requests"]["by_outcome"]
    assert (
        report["requests"]["total"] >= 8
        and outcomes.get("stream_completed")
        and outcomes.get("non_stream_completed")
    )
    assert len(report["samples"]) >= 10 and all(s["rss_mib"] > 0 for s in report["samples"])
    assert report["growth_after_warmup_percent"] is not None
    # every request the clients finished or cut is a line the server logged and counted
    assert sum(report["server_completions"].values()) >= report["requests"]["total"] - 4  # 4 cut at the end
