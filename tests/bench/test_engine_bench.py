"""bench/engine.py's pieces that need no model."""

from __future__ import annotations

from bench.engine import run_probe, summarize


def test_run_probe_when_probe_outlives_timeout_then_error_entry_not_exception():
    cfg = {"engine": "llama.cpp", "gguf": "/nonexistent.gguf", "threads": 1}
    result = run_probe(cfg, timeout=0.01)
    assert result["config"] == cfg and "no result within" in result["error"][0]
    assert summarize([result])["runs"] == 0
