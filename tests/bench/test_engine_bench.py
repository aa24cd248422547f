"""bench/engine_bench.py's pieces that need no model."""

from __future__ import annotations

from bench.engine_bench import run_probe, summarize


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


def test_workload_probe_when_peers_then_each_replies_and_simmer_is_compared_with_it(
    tiny_gguf, tiny_model_dir
):
    """llama.cpp plain and with its prompt lookup on the GGUF, onnxruntime-genai on the converted folder,
    interleaved with simmer in one process; the summary gives simmer over each peer. genai runs the same
    q4 graph with one-row decode steps, so its greedy reply is simmer's plain one."""
    import pytest

    pytest.importorskip("llama_cpp")
    pytest.importorskip("onnxruntime_genai")
    from bench.engine_bench import summarize_workload
    from bench.workload_probe import PEERS, probe

    cfg = {"model_dir": str(tiny_model_dir), "variant": "q4", "threads": 1, "workload": "rewrite"}
    cfg |= {"gguf": str(tiny_gguf), "peers": list(PEERS), "max_tokens": 12, "prompt_tail": 200}
    res = probe(cfg)
    for peer in PEERS:
        assert res[peer]["tokens"] > 0 and res[peer]["decode_tok_s"] > 0
        assert set(res["vs_peers"][peer]) == {"decode_tok_s", "tokens_per_cpu_s"}
    assert all(t[0]["first_difference_vs_off"]["genai"] is None for t in res["tasks"].values())
    row = summarize_workload([res], PEERS)
    assert row["runs"] == 1 and set(row["vs_peers"]) == set(PEERS)
    assert set(row["llama_cpp_lookup_vs_plain"]) == set(res["tasks"])
    assert row["decode_tok_s_llama.cpp-lookup"] == res["llama.cpp-lookup"]["decode_tok_s"]
