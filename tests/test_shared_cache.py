"""The test cache (~/.cache/simmer-test) is shared by the pytest-xdist workers of one run and by other runs:
two processes that build the same converted model at once must both end with it, converted once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A process that builds `target` with tests/conftest.py's _convert_into. Its converter first notes that it
# started, then waits (up to 3 s) for the other process to start converting too: without the lock both
# convert and the second rename fails; with it, the second waits for the lock and finds the model there.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import models.convert.pipeline as pipeline
    from tests.conftest import _convert_into

    gguf, target, log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    real = pipeline.convert

    def convert(*args, **kwargs):
        with log.open("a") as f:
            f.write("started\\n")
        deadline = time.monotonic() + 3
        while log.read_text().count("started") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(*args, **kwargs)

    pipeline.convert = convert
    _convert_into(gguf, target, threads=1, variants=["q4"], measure=False)
    assert (target / "manifest.json").exists()
    """
)


def test_convert_into_when_two_processes_build_one_model_then_both_get_it_converted_once(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    target, log = tmp_path / "cache" / "tiny", tmp_path / "log"
    log.touch()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tiny_gguf), str(target), str(log)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert log.read_text().count("started") == 1
    assert (target / "manifest.json").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [".tiny.lock", "tiny"]  # no temp folder left
