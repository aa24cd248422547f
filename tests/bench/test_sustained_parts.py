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
