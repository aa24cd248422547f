"""A session's heap once warm: onnxruntime's memory patterns (one plan cached per distinct set of input
shapes, never dropped) would grow it by a plan for every attention length a decode step sees; our sessions
turn them off, so decoding through new positions allocates nothing that stays.

Measured in a child process (a clean heap) as glibc's bytes in use (mallinfo2), not RSS: the plans are small
heap blocks. A control with the patterns forced on shows the measurement sees the growth."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.runtime.session import session_options

SCRIPT = """
import json, sys
from pathlib import Path
import numpy as np
import models.runtime.session as S
from bench.memory import heap_in_use as in_use

folder, patterns = Path(sys.argv[1]), sys.argv[2]
if patterns == "on":  # the control: onnxruntime's default
    ours = S.session_options
    def forced(threads, spinning=False):
        so = ours(threads, spinning)
        so.enable_mem_pattern = True
        return so
    S.session_options = forced
manifest = json.loads((folder / "manifest.json").read_text())
shape = S.ModelShape.from_architecture(manifest["architecture"])
sess = S.DecoderSession(folder / manifest["variants"]["f32"]["file"], shape, 1)
kv = S.KVCache(shape, 256)

token = np.array([5])
sess.run(np.array([1, 2, 3]), kv, 0)
for p in range(3, 40):  # warm: the arena holds what a step needs
    sess.run(token, kv, p)
before = in_use()
for p in range(40, 256):  # attention lengths never seen (the tiny model's context: 256)
    sess.run(token, kv, p)
print(json.dumps((in_use() - before) / 2**20))
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def test_session_options_turn_memory_patterns_off() -> None:
    assert session_options(1).enable_mem_pattern is False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc's mallinfo2")
def test_decoding_new_positions_when_warm_then_heap_in_use_stays_flat(tiny_model_dir) -> None:
    def grown_mb(patterns: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tiny_model_dir), patterns],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    control = grown_mb("on")
    ours = grown_mb("ours")
    assert control >= 0.2, control  # a plan per length: the measurement sees it (~1 KB a layer a length)
    assert ours <= 0.1 * control, (ours, control)


# -- a session rebuilt mid-reply (the governor's thread change) -------------------------------------------
def test_thread_change_when_mid_reply_then_the_old_session_is_gone_before_the_next_is_built(
    tiny_model_dir, monkeypatch
) -> None:
    """Built beside the session it replaces, a session's packed weights were held twice at the peak, and
    the old one, freed after the engine had handed the heap back, stayed with glibc for good."""
    import weakref

    import models.runtime.engine as engine_module
    from models.protocol import EngineLimits
    from models.runtime.engine import load_engine
    from models.types import GenerationParams, SamplingParams

    built: list[weakref.ref] = []
    alive_at_build: list[int] = []

    class Observed(engine_module.DecoderSession):
        def __init__(self, *args, **kwargs) -> None:
            alive_at_build.append(sum(ref() is not None for ref in built))
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(engine_module, "DecoderSession", Observed)
    engine = load_engine(tiny_model_dir, variant="q4", threads=2, context_length=128)
    steps = 0

    def change_threads() -> EngineLimits | None:
        nonlocal steps
        steps += 1
        return EngineLimits(threads=1) if steps == 4 else None

    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True)
    events = list(engine.generate(engine.text_prompt("hello"), params, step_hook=change_threads))
    assert engine.threads == 1 and len(built) == 2 and len(events) == 9
    assert alive_at_build == [0, 0]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc, /proc")
def test_thread_change_when_mid_reply_then_rss_over_ten_replies_stays_within_5_mb(smollm2_model_dir) -> None:
    """studies.experiments.warm_memory's window on SmolLM2 q4-a8, on a worker thread as the server runs
    it: warm on 2 threads, then ten replies, the first of which moves to 1 thread mid-reply. Before the
    fix the old session's packed weights stayed resident: +96 MB at the change, for good."""
    script = (
        "import json, sys; from pathlib import Path; from studies.experiments.warm_memory import run; "
        "print(json.dumps(run(Path(sys.argv[1]), 10, 'q4-a8', max_tokens=24)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(smollm2_model_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],  # studies/ is no installed package: the repository's root
    )
    result = json.loads(out.stdout)
    assert [r["threads"] for r in result["replies"]] == [1] * 10  # the change happened in the window
    assert result["growth_mb_warm_to_reply_10"] <= 5.0, result
