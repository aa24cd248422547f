"""bench/engine.py's pieces that need no model."""

from __future__ import annotations

from bench.engine import run_probe, summarize


def test_run_probe_when_probe_outlives_timeout_then_error_entry_not_exception():
    cfg = {"engine": "llama.cpp", "gguf": "/nonexistent.gguf", "threads": 1}
    result = run_probe(cfg, timeout=0.01)
    assert result["config"] == cfg and "no result within" in result["error"][0]
    assert summarize([result])["runs"] == 0


def test_workload_probe_when_tiny_model_then_both_modes_same_tokens_and_speculation_counted(tiny_model_dir):
    """The rewrite workload's A/B probe, in-process on the tiny model: the replies agree token for token
    and the speculating mode drafted (its numbers are not checked: no timing in unit tests)."""
    from bench.workload_probe import probe

    cfg = {"model_dir": str(tiny_model_dir), "variant": "q4", "threads": 1, "workload": "rewrite"}
    res = probe(cfg | {"max_tokens": 24, "prompt_tail": 200})  # the tiny model has 256 positions
    assert res["speculates"] and res["identical_tokens"]
    assert res["off"]["tokens"] == res["auto"]["tokens"] > 0
    assert res["off"]["draft_n"] == 0 < res["auto"]["draft_n"]
    assert set(res["tasks"]) == {"correct", "rewrite", "extract", "summarize"}
