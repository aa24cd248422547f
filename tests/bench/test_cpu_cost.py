"""bench/cpu_cost: the counter's arithmetic, and a count of the tiny model's decode steps under qemu.

The counted tests need Debian's dynamic qemu-user (/usr/bin/qemu-x86_64, qemu-aarch64) and a C compiler for
the plugin; the arm64 one also the unpacked arm64 root (SIMMER_ARM64_ROOT: tests/arm64/run.sh sets it). They
build llama.cpp for the class on the first run (bench/cpu_cost/build.sh; ~10 min on 2 cores, kept after):
`make test` runs the AVX2 one only where that build is there already; `make test-avx2` builds it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import pytest

from bench.cpu_cost.count import CLASSES, parse, phases
from bench.cpu_cost.run import build, count_llama, count_simmer, prompt_ids

DECODE = 4


def test_parse_when_counter_output_then_total_threads_and_marks() -> None:
    assert parse("insns 100\nvcpus 2\nmark 10\nmark 40\n") == (100, 2, [10, 40])


def test_phases_when_decode_steps_then_second_half_over_n() -> None:
    # start-up 1000, prefill 400 over 4 tokens, steps 50, 60 (first half), 30, 30 (second)
    marks = [1000, 1400, 1450, 1510, 1540, 1570]
    got = phases(marks, prompt_tokens=4, decode=4)
    assert got["startup_insns"] == 1000
    assert got["insns_per_prompt_token"] == 100
    assert got["insns_per_decoded_token"] == 30
    assert got["insns_per_decoded_token_first_half"] == 55
    assert (got["decode_step_min"], got["decode_step_max"]) == (30, 60)


def test_phases_when_markers_missing_then_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        phases([1, 2, 3], prompt_tokens=4, decode=4)


def counted_tiny(cpu_name: str, model_dir: Path, gguf: Path, root: Path | None) -> None:
    cpu = CLASSES[cpu_name]
    if not Path(cpu.qemu).exists() or shutil.which("gcc") is None:
        pytest.skip(f"needs {cpu.qemu} (Debian's qemu-user) and gcc")
    plugin = build("plugin")
    vocab = int(json.loads((model_dir / "manifest.json").read_text())["architecture"]["vocab"])
    ids = prompt_ids(8, vocab)
    simmer = count_simmer(cpu, plugin, model_dir, "q4", ids, DECODE, root)
    llama = count_llama(cpu, plugin, gguf, ids, DECODE, root)
    for r in (simmer, llama):
        assert r["insns_per_decoded_token"] > 0 and r["insns_per_prompt_token"] > 0
        # a decode step is a small part of what starting the program costs, and steps are alike
        assert r["insns_per_decoded_token"] < r["startup_insns"] / 10
        assert r["decode_step_max"] < 3 * r["decode_step_min"]
        assert len(r["tokens"].split(",")) == DECODE
    assert simmer["weight_bytes_per_decoded_token"] > 0


def built(cpu_name: str) -> bool:
    """llama.cpp's guest for the class is in build.sh's cache (building it takes ~10 minutes on 2 cores)."""
    out = Path(os.environ.get("SIMMER_CPU_COST_BUILD", Path.home() / ".cache" / "simmer-cpu-cost"))
    return (out / f"llama_count-{cpu_name}").is_file()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86 CPU on an x86_64 machine")
def test_cpu_cost_when_tiny_model_on_avx2_then_decode_steps_counted(tiny_model_dir, tiny_gguf) -> None:
    if not (os.environ.get("SIMMER_COUNT_CPU") or built("avx2")):
        pytest.skip("llama.cpp for AVX2 not built: make test-avx2 builds it (~10 min once) and runs this")
    counted_tiny("avx2", tiny_model_dir, tiny_gguf, None)


@pytest.mark.skipif(not os.environ.get("SIMMER_ARM64_ROOT"), reason="needs the arm64 root (make test-arm64)")
def test_cpu_cost_when_tiny_model_on_cortex_a76_then_decode_steps_counted(tiny_model_dir, tiny_gguf) -> None:
    counted_tiny("cortex-a76", tiny_model_dir, tiny_gguf, Path(os.environ["SIMMER_ARM64_ROOT"]))
