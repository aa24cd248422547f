"""Open llama.cpp (llama-cpp-python) as the benchmarks' peer, on CPUs where its AMX kernels fault.

Some virtual machines report AMX in cpuid and grant the tile permission, yet fault on the first tile
instruction (SIGILL in libggml-cpu's AMX matmul, reached by any multi-token batch; measured on this
project's Firecracker build machines). llama.cpp has no switch for AMX alone: `use_extra_bufts = false`
turns off its extra weight buffers, AMX and the CPU repacking of Q4_0/Q4_K alike, which costs it speed.
`extra_bufts_work` finds out once, in a child process, whether a batch evaluates; the probes then open the
peer with extra buffers only where they work, and the report says which.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

CHECK = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, n_batch=32, verbose=False)
llm.eval(llm.tokenize(b"one two three four five six seven eight nine ten", add_bos=False))
"""


def extra_bufts_work(gguf: Path) -> bool:
    """Whether llama.cpp evaluates a multi-token batch of this GGUF with its extra buffers (AMX, repack)."""
    proc = subprocess.run([sys.executable, "-c", CHECK, str(gguf)], capture_output=True, timeout=600)
    if proc.returncode == -signal.SIGILL:
        return False
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp could not evaluate {gguf.name}: {proc.stderr.decode()[-500:]}")
    return True


def open_llama(gguf: str, *, extra_bufts: bool | None = None, **kwargs: Any) -> Any:
    """llama_cpp.Llama, with llama.cpp's extra weight buffers off when `extra_bufts` is False (None: on
    where they work, found out by extra_bufts_work)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    if extra_bufts is None:
        extra_bufts = extra_bufts_work(Path(gguf))
    if extra_bufts:
        return llama_cpp.Llama(gguf, **kwargs)
    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        return llama_cpp.Llama(gguf, **kwargs)
    finally:
        lib.llama_model_default_params = default
