"""Pure parts of the engine benchmark: which configurations run, their names, the energy table."""

from __future__ import annotations

from pathlib import Path

from bench.engine_bench import config_name, energy, simmer_configs


def test_simmer_configs_when_threads_then_one_thread_once_and_pools_with_and_without_spinning():
    configs = simmer_configs(Path("/m"), ["q4", "q4-a8"], [2, 1])
    names = [config_name(c) for c in configs]
    assert names == [
        "simmer:q4:t2",
        "simmer:q4:t2:spin-off",
        "simmer:q4:t1",
        "simmer:q4-a8:t2",
        "simmer:q4-a8:t2:spin-off",
        "simmer:q4-a8:t1",
    ]
    assert config_name({"engine": "llama.cpp", "threads": 2}) == "llama.cpp:gguf:t2"


def test_energy_when_summaries_then_cheapest_first_with_ratio_to_llama_cpp_at_the_same_threads():
    summary = {
        "simmer:q4-a8:t2": {"cpu_s_per_token": 0.0228, "decode_tok_s_short": 80.0},
        "simmer:q4-a8:t2:spin-off": {"cpu_s_per_token": 0.0190, "decode_tok_s_short": 62.0},
        "simmer:q4-a8:t1": {"cpu_s_per_token": 0.0154, "decode_tok_s_short": 60.0},
        "llama.cpp:gguf:t1": {"cpu_s_per_token": 0.01825},
        "llama.cpp:gguf:t2": {"cpu_s_per_token": 0.01745},
        "simmer:q4:t1": {"error": ["boom"], "runs": 0},
    }
    e = energy(summary)
    assert list(e["configs"]) == [
        "simmer:q4-a8:t1",
        "llama.cpp:gguf:t2",
        "llama.cpp:gguf:t1",
        "simmer:q4-a8:t2:spin-off",
        "simmer:q4-a8:t2",
    ]
    assert e["configs"]["simmer:q4-a8:t1"]["tok_per_cpu_s"] == 64.9
    assert e["configs"]["simmer:q4-a8:t1"]["tok_per_cpu_s_vs_llama_cpp"] == 1.19
    assert e["configs"]["simmer:q4-a8:t2"]["tok_per_cpu_s_vs_llama_cpp"] == 0.77
    assert e["configs"]["llama.cpp:gguf:t1"]["tok_per_cpu_s_vs_llama_cpp"] is None
    assert e["cheapest_simmer"] == "simmer:q4-a8:t1"
    assert e["default_configs_at_least_llama_cpp"] == {"simmer:q4-a8:t1": True, "simmer:q4-a8:t2": False}


def test_quality_and_disk_when_manifest_then_each_variant_and_llama_cpp_side_by_side(tmp_path):
    import json

    from bench.engine_bench import quality_and_disk, ratios
    from bench.report import variants_table

    (tmp_path / "fast.onnx").write_bytes(b"x" * 10)
    (tmp_path / "weights.data").write_bytes(b"x" * 2_000_000)
    (tmp_path / "fast.data").write_bytes(b"x" * 1_000_000)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 2_500_000)
    manifest = {
        "default_variant": "fast",
        "variants": {
            "fast": {
                "files": ["fast.onnx", "weights.data", "fast.data"],
                "quality": {"kl_mean": 0.001, "kl_p99": 0.006, "top1_agreement": 0.99},
            }
        },
        "quality_floor": {"source": "llama.cpp", "kl_mean": 0.002, "kl_p99": 0.012, "top1_agreement": 0.98},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    qd = quality_and_disk(tmp_path, gguf, ["fast"])
    assert qd["fast"] == {"kl_mean": 0.001, "kl_p99": 0.006, "top1_agreement": 0.99, "disk_mb": 3.0}
    assert qd["gguf"]["kl_mean"] == 0.002 and qd["gguf"]["disk_mb"] == 2.5 and qd["default_variant"] == "fast"
    run = {
        "prompt_tok_s": 100.0,
        "decode_tok_s_ctx500": 30.0,
        "decode_tok_s_short": 33.0,
        "ttft_ms": 50.0,
        "peak_rss_mb": 500.0,
        "cpu_s_per_token": 0.04,
        "greedy_known": "x",
    }
    peer = run | {"decode_tok_s_short": 30.0, "cpu_s_per_token": 0.05, "peak_rss_mb": 400.0}
    summary = {"simmer:fast:t2": run, "llama.cpp:gguf:t2": peer}
    r = ratios(summary, ["fast"], [2], qd)["fast:t2"]
    assert (r["decode_tok_s_short"], r["tok_per_cpu_s"], r["peak_rss_ratio"]) == (1.1, 1.25, 1.25)
    assert (r["kl_mean_vs_llama_cpp"], r["kl_p99_vs_llama_cpp"]) == (0.5, 0.5)
    table = variants_table([{"model_dir": str(tmp_path), "results": summary, "quality_and_disk": qd}])
    row = table.splitlines()[2]
    assert "fast (default)" in row and "33.0 vs 30.0 (1.10x)" in row and "0.00100 vs 0.00200 (0.50x)" in row
