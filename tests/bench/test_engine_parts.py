"""Pure parts of the engine benchmark: which configurations run, their names, the energy table."""

from __future__ import annotations

from pathlib import Path

from bench.engine import config_name, energy, simmer_configs


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
