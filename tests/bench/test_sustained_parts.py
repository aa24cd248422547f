"""Pure parts of the sustained benchmark: the offline audit, settings for the child, token spread."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sustained.audit import is_loopback, summarize_audit
from bench.sustained.client import RunLog, _spread_tokens
from bench.sustained.measure import percentile
from bench.sustained.process import settings_env
from server.settings import Settings


def test_summarize_audit_when_only_loopback_then_offline_ok():
    lines = ["bind 127.0.0.1 8000", "connect ::1 8000", "getaddrinfo localhost 8000", "connect unix '/tmp/s'"]
    summary = summarize_audit(lines)
    assert summary["offline_ok"] is True
    assert summary["socket_events"] == 4


def test_summarize_audit_when_remote_connect_then_not_offline_and_named():
    summary = summarize_audit(
        ["connect 127.0.0.1 80", "connect 151.101.0.223 443", "getaddrinfo pypi.org 443"]
    )
    assert summary["offline_ok"] is False
    assert summary["non_loopback"] == ["connect 151.101.0.223 443", "getaddrinfo pypi.org 443"]


def test_is_loopback_when_addresses_then_only_local_ones():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")


def test_settings_env_when_read_back_from_environment_then_same_settings(tmp_path: Path, monkeypatch):
    settings = Settings(
        home=tmp_path,
        governor=False,
        thermal_source="sim:phone",
        sim_time_scale=10.0,
        cors_origins=["http://a"],
    )
    env = settings_env(settings)
    assert env["SIMMER_GOVERNOR"] == "false"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    again = Settings()
    assert again == settings


def test_spread_tokens_when_usage_known_then_each_chunk_gets_its_share():
    log = RunLog()
    total = _spread_tokens([(1.0, 4), (2.0, 12)], 8, log)
    assert total == 8
    assert log.token_times == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    # a reply cut before its usage: characters per token of the replies before it
    assert _spread_tokens([(3.0, 6)], None, log) == 3


# -- energy, mid-reply pauses, the envelope's limit ---------------------------------------------------------
def test_count_pause_when_governor_events_then_only_pauses_after_the_first_token_count():
    from bench.sustained.client import RequestRecord, _count_pause

    rec = RequestRecord(start=0.0, ttft_s=None, tokens=0, ok=False)
    paused = _count_pause(rec, {"limits": {"pause_running": True}}, False)  # queued: not mid-reply
    assert paused and rec.pauses == 0
    rec.ttft_s = 0.1
    paused = _count_pause(rec, {"limits": {"pause_running": False}}, paused)
    paused = _count_pause(rec, {"limits": {"pause_running": True}}, paused)
    paused = _count_pause(rec, {"limits": {"pause_running": True}}, paused)  # still the same pause
    assert rec.pauses == 1 and len(rec.pause_times) == 1
    _count_pause(rec, {"level": "serious", "limits": {"pause_running": False}}, paused)
    assert rec.pauses == 1


def test_energy_summary_when_cpu_and_tokens_then_tokens_per_cpu_second_and_busy_cores():
    from bench.sustained.client import RequestRecord
    from bench.sustained.measure import energy_summary

    log = RunLog()
    # 600 simulated s at time_scale 10 = 60 wall s; the server spends 0.9 core: 54 CPU s
    log.cpu = [(float(t), 0.09 * t) for t in range(0, 601, 10)]
    tok_s = [60.0] * 600  # 60 tok per wall s: 3600 tokens
    late = RequestRecord(start=0.0, ttft_s=0.1, tokens=160, ok=True, pauses=1, pause_times=[100.0 + 13.0])
    early = RequestRecord(start=0.0, ttft_s=0.1, tokens=160, ok=True, pauses=1, pause_times=[100.0 + 2.0])
    log.requests = [early, late]
    out = energy_summary(log, tok_s, 600, 10.0, t0=100.0)
    assert out["server_cpu_s"] == 54.0
    assert out["tok_per_cpu_s"] == round(3600 / 54, 2)
    assert out["tok_per_cpu_s_last_5min"] == round(1800 / 27, 2)
    assert out["busy_cores_last_5min"] == 0.9
    assert (out["mid_reply_pauses"], out["mid_reply_pauses_after_warm_up"], out["replies_paused"]) == (
        2,
        1,
        2,
    )


def test_goodput_when_replies_fail_then_their_tokens_count_for_nothing():
    from bench.sustained.client import RequestRecord
    from bench.sustained.measure import energy_summary, goodput_per_s

    log = RunLog()
    done = RequestRecord(start=0.0, ttft_s=0.1, tokens=3, ok=True)
    failed = RequestRecord(start=0.0, ttft_s=0.1, tokens=2, ok=False, error="device_overheated")
    _spread_tokens([(100.05, 3)], 3, log, done)
    _spread_tokens([(100.25, 2)], 2, log, failed)
    log.requests = [done, failed]
    log.cpu = [(0.0, 0.0), (10.0, 1.0)]
    # time_scale 10: wall 100.05 is simulated second 0, wall 100.25 second 2
    assert goodput_per_s(log, 10, 10.0, t0=100.0) == [30.0] + [0.0] * 9
    tok_s = [30.0, 0.0, 20.0] + [0.0] * 7  # every token sent
    out = energy_summary(log, tok_s, 10, 10.0, t0=100.0)
    assert out["tok_per_cpu_s"] == 5.0 and out["goodput_per_cpu_s"] == 3.0


def test_envelope_when_runs_then_limit_from_the_simulator_and_best_measured_tokens_per_cpu():
    from bench.sustained.measure import envelope
    from bench.sustained.modes import pace_targets
    from governor.thermal_sim import get_profile

    runs = {
        "governed": {
            "goodput_per_cpu_s": 64.0,
            "tok_s_last_5min": 57.0,
            "goodput_tok_s_last_5min": 57.0,
            "tok_s_mean": 58.0,
        },
        # sends more tokens per CPU-second than any other run, but its replies fail: no user got them
        "ungoverned": {
            "tok_per_cpu_s": 90.0,
            "goodput_per_cpu_s": 44.0,
            "tok_s_last_5min": 30.0,
            "goodput_tok_s_last_5min": 1.0,
            "tok_s_mean": 40.0,
        },
    }
    env = envelope("phone", runs)
    cores = get_profile("phone").sustainable_cores()
    assert env["sustainable_cores_at_t_throttle"] == round(cores, 3) == 0.918
    assert env["best_goodput_per_cpu_s_run"] == "governed"
    assert env["limit_tok_s"] == round(cores * 64.0, 2)
    assert env["efficiency"] == round(57.0 / (cores * 64.0), 3)
    assert envelope("phone", runs, governed="ungoverned")["efficiency"] == round(1.0 / (cores * 64.0), 3)
    runs["governed"]["mid_reply_pauses_after_warm_up"] = 0
    runs["levels"] = {"tok_s_mean": 50.0}
    targets = pace_targets(runs, env)
    assert targets["governed_no_mid_reply_pause_after_warm_up"] is True
    assert targets["efficiency_ok (>= 0.95)"] is (env["efficiency"] >= 0.95)
    assert targets["governed_tok_s_at_least_levels"] is True


def test_settings_env_when_routing_settings_then_child_gets_the_same(tmp_path: Path, monkeypatch):
    """The key must reach the child as itself (not pydantic's '**********'), the model map as JSON."""
    settings = Settings(
        home=tmp_path,
        route="auto",
        upstream_url="http://127.0.0.1:9/v1",
        upstream_api_key="sk-child",
        upstream_models={"big": "org/Big"},
    )
    env = settings_env(settings)
    assert env["SIMMER_UPSTREAM_API_KEY"] == "sk-child"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Settings() == settings


def test_percentile_when_nearest_rank_then_a_real_value():
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 95) == 19.0 and percentile(values, 50) == 10.0 and percentile([3.0], 95) == 3.0


# -- the ladder benchmark ----------------------------------------------------------------------------------
def test_request_body_when_completions_then_a_text_prompt_naming_the_model():
    from bench.sustained.client import request_body

    body = request_body("Why?", 3, "completions", "gemma3-270m")
    assert body["prompt"].startswith("Question: Why?") and "messages" not in body
    assert (body["model"], body["seed"]) == ("gemma3-270m", 3)
    assert body["stream_options"] == {"include_usage": True}
    chat = request_body("Why?", 0)
    assert chat["messages"] == [{"role": "user", "content": "Why?"}] and "model" not in chat


def test_chunk_text_when_chat_or_completions_chunk_then_its_text():
    from bench.sustained.client import _chunk_text

    assert _chunk_text({"delta": {"content": "a"}}) == "a"
    assert _chunk_text({"delta": {}}) == ""
    assert _chunk_text({"text": "b", "index": 0}) == "b"


def test_moves_from_log_when_server_log_then_rung_moves_switches_and_unloads_counted():
    from bench.sustained.run import moves_from_log

    lines = [
        "2026-12-01 07:00:00,000 INFO simmer.governor: nominal -> serious: forecast",
        "2026-12-01 07:00:00,001 INFO simmer.governor: rung gemma3-270m/q4-a8 -> smollm2/q4-a8: serious (x)",
        "2026-12-01 07:00:00,002 INFO simmer.server: cmpl-1: the governor moves the reply to smollm2 (why)",
        "2026-12-01 07:00:00,003 INFO simmer.pool: unloaded gemma3-270m: the governor's rung is smollm2",
        "2026-12-01 07:00:09,000 INFO simmer.governor: rung smollm2/q4-a8 -> gemma3-270m/q4-a8: fair (y)",
    ]
    moves = moves_from_log(lines)
    assert moves["rung_moves"] == 2 and moves["replies_moved"] == 1
    assert moves["rung_log"][0] == "gemma3-270m/q4-a8 -> smollm2/q4-a8: serious (x)"
    assert moves["unloads"] == ["gemma3-270m: the governor's rung is smollm2"]


def test_tokens_per_model_when_replies_moved_then_summed_per_model():
    from bench.sustained.client import RequestRecord
    from bench.sustained.measure import tokens_per_model

    a = RequestRecord(0.0, 0.1, 10, True, models={"big": 4, "small": 6})
    b = RequestRecord(0.0, 0.1, 5, True, models={"small": 5})
    assert tokens_per_model([a, b, RequestRecord(0.0, None, 0, False)]) == {"big": 4, "small": 11}


def test_ladder_targets_when_runs_then_ratio_peak_failures_and_growth_judged():
    from bench.sustained.ladder import ladder_runs, ladder_targets

    def run(tok_s, peak, failed, after_1, after_10, warm=None, span=10):
        return {
            "tok_s_last_5min": tok_s,
            "peak_temperature_c": peak,
            "throttle_c": 43.0,
            "failed_requests": failed,
            "rss_mb": {"after_1_request": after_1, "after_10_requests": after_10},
            "memory_once_warm": {"growth_mb": warm, "requests_after_warm": span},
        }

    ok = "memory_growth_ok (<= 5 MB once warm)"
    cold = "ladder_memory_growth_mb_cold (rss after request 10 - after request 1)"
    # cold growth of 11 MB (the second model loading) but 3 MB once warm: the target is the warm one
    runs = {"ladder": run(30.0, 43.5, 0, 500.0, 511.0, warm=3.0), "variants": run(20.0, 43.2, 0, 1, 1)}
    runs["ungoverned"] = run(12.0, 60.0, 2, 500.0, 500.0)
    t = ladder_targets(runs)
    assert t["ladder_over_ungoverned_tok_s_last_5min"] == 2.5
    assert t["tok_s_ratio_ok (>= 2)"] and t["ladder_peak_below_throttle_plus_1"] and t["ladder_zero_failed"]
    assert t[ok] and t["variants_over_ungoverned_tok_s_last_5min"] == 1.667
    assert (
        t[cold] == 11.0
        and t["ladder_memory_growth_mb_once_warm (10 requests after every model in use served once)"] == 3.0
    )
    runs["ladder"] = run(20.0, 44.0, 1, 500.0, 506.0, warm=6.0)
    t = ladder_targets(runs)
    verdicts = ["tok_s_ratio_ok (>= 2)", "ladder_peak_below_throttle_plus_1", "ladder_zero_failed"]
    assert not any(t[k] for k in verdicts) and t[ok] is False
    runs["ladder"] = run(30.0, 43.5, 0, 500.0, 501.0, warm=None)  # never warm: not judged ok
    assert ladder_targets(runs)[ok] is False
    runs["ladder"] = run(30.0, 43.5, 0, 500.0, 501.0, warm=1.0, span=2)  # 2 requests after warm: too few
    t = ladder_targets(runs)
    assert t[ok] is False and t["ladder_memory_requests_after_warm"] == 2
    names = [(name, update.get("ladder"), update["governor"]) for name, update in ladder_runs("a,b:q4")]
    assert names == [("ladder", "a,b:q4", True), ("variants", None, True), ("ungoverned", None, False)]
    assert all(update["model"] == "a" for _, update in ladder_runs("a,b:q4"))


def test_warm_memory_when_second_model_serves_late_then_growth_counts_from_its_first_reply():
    from bench.sustained.client import RequestRecord
    from bench.sustained.measure import warm_memory

    mb = 2**20
    reqs = [RequestRecord(0.0, 0.1, 5, True, models={"big": 5}) for _ in range(3)]
    reqs.append(RequestRecord(0.0, 0.1, 5, True, models={"big": 2, "small": 3}))  # request 4: warm
    reqs += [RequestRecord(0.0, 0.1, 5, True, models={"small": 5}) for _ in range(12)]
    # the second model's sessions come in at request 4 (+60 MB), then 2 MB over the next 10 requests
    rss = {i: (500 + (60 if i >= 4 else 0) + (0.2 * (i - 4) if i > 4 else 0)) * mb for i in range(1, 17)}
    w = warm_memory(reqs, {i: int(v) for i, v in rss.items()})
    assert w["warm_after_request"] == 4 and w["models_in_use"] == ["big", "small"]
    assert w["requests_after_warm"] == 10 and w["growth_mb"] == 2.0
    assert len(w["rss_mb_window"]) == 11 and w["rss_mb_warm"] == 560.0
    # a run that ends 3 requests after it is warm measures those 3; one warm only at its end, nothing
    short = warm_memory(reqs[:7], {i: int(rss[i]) for i in range(1, 8)})
    assert short["requests_after_warm"] == 3 and short["growth_mb"] == 0.6
    assert (
        warm_memory(reqs[:4], {i: int(rss[i]) for i in range(1, 5)})["growth_mb"] is None
    )  # warm at the end
    assert warm_memory([], {})["warm_after_request"] is None


@pytest.mark.parametrize(
    ("governed", "ungoverned", "ratio", "ok"),
    [
        # the heatwave of 2026-12-02: the ungoverned run sent 4.6 tok/s and completed no reply
        ((2.2, 2.2), (0.0, 4.6), None, True),
        ((31.5, 31.5), (2.67, 17.63), 11.798, True),
        ((10.0, 10.0), (10.0, 10.0), 1.0, False),
        ((0.0, 3.0), (0.0, 3.0), None, False),  # neither completed anything: no win
    ],
)
def test_governed_over_ungoverned_when_counted_then_goodput_not_tokens_sent(governed, ungoverned, ratio, ok):
    from bench.sustained.modes import governed_over_ungoverned

    def run(good: float, sent: float) -> dict:
        return {"goodput_tok_s_last_5min": good, "tok_s_last_5min": sent}

    t = governed_over_ungoverned(run(*governed), run(*ungoverned))
    assert t["governed_over_ungoverned_goodput_last_5min"] == ratio
    assert t["goodput_ratio_ok (>= 1.2)"] is ok
