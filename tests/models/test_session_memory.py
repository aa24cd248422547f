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
