"""Pure parts of the sustained benchmark: the offline audit, settings for the child, token spread."""

from __future__ import annotations

from pathlib import Path

from bench.sustained import RunLog, _spread_tokens, is_loopback, percentile, settings_env, summarize_audit
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


# -- issue 16: energy, mid-reply pauses, the envelope's limit ------------------------------------------------
def test_count_pause_when_governor_events_then_only_pauses_after_the_first_token_count():
    from bench.sustained import RequestRecord, _count_pause

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
    from bench.sustained import RequestRecord, energy_summary

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


def test_envelope_when_runs_then_limit_from_the_simulator_and_best_measured_tokens_per_cpu():
    from bench.sustained import envelope, pace_targets
    from governor.thermal_sim import get_profile

    runs = {
        "governed": {"tok_per_cpu_s": 64.0, "tok_s_last_5min": 57.0, "tok_s_mean": 58.0},
        "ungoverned": {"tok_per_cpu_s": 44.0, "tok_s_last_5min": 30.0, "tok_s_mean": 40.0},
    }
    env = envelope("phone", runs)
    cores = get_profile("phone").sustainable_cores()
    assert env["sustainable_cores_at_t_throttle"] == round(cores, 3) == 0.918
    assert env["best_tok_per_cpu_s_run"] == "governed"
    assert env["limit_tok_s"] == round(cores * 64.0, 2)
    assert env["efficiency"] == round(57.0 / (cores * 64.0), 3)
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
