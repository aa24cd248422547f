"""llama.cpp's own server unit tests, run against simmer: the `tools/server/tests/unit` files of the
llama-cpp-python 0.3.36 sdist (a test dependency already: the peer), through the shim in
tests/server/llamacpp_shim.py, which starts simmer on the real default model where they start llama-server.

The sdist is fetched with pip (`pip download --no-binary :all:`: pip's cache serves it after the first
time) and its tests are kept in the shared test cache. The run is a subprocess (their conftest.py and
`utils` module are their own), on a copy of the files with RELAXED applied: each replacement turns an
assertion of what stories260K (the model llama.cpp's tests run) says or counts, or llama-server's build
number, into the shape it stands for, and each must be found exactly once. Every case passes or is
skipped as not applicable, with its reason (llama-server-only features: NOT_APPLICABLE in the shim)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import conftest as shared
from tests.server.llamacpp_cases import NOT_APPLICABLE, RELAXED

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
INSIDE = "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests/"
FILES = [
    "unit/test_basic.py",
    "unit/test_tokenize.py",
    "unit/test_chat_completion.py",
    "unit/test_completion.py",
    "unit/test_compat_oai_responses.py",
    "unit/test_security.py",
]
REPO = Path(__file__).resolve().parents[3]
NO_BINARY = ["--no-binary", ":all:"]  # the sdist, whatever wheel pip's cache holds
# their pytest.ini, our shim, no cache folder, their warnings as warnings
PYTEST_ARGS = ["-p", "tests.server.llamacpp_shim", "-p", "no:cacheprovider", "-q", "-rfE", "-o", "addopts="]


def fetch_tests(cache: Path) -> Path:
    """The sdist's server tests folder, extracted once into the shared cache."""
    target = cache / "llama.cpp-server-tests-0.3.36"

    def build() -> None:
        sdists = cache / "sdists"
        sdists.mkdir(parents=True, exist_ok=True)
        if not (sdists / SDIST_FILE).exists():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    *NO_BINARY,
                    SDIST,
                    "-d",
                    str(sdists),
                ],
                check=True,
            )
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdists / SDIST_FILE) as tar:
            for member in tar.getmembers():
                if (
                    member.isfile()
                    and member.name.startswith(INSIDE)
                    and member.name.endswith((".py", ".ini"))
                ):
                    out = tmp / member.name[len(INSIDE) :]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    assert source is not None
                    out.write_bytes(source.read())
        tmp.rename(target)

    return shared.build_once(target, (target / "utils.py").exists, build)


def relaxed_copy(source: Path, into: Path) -> Path:
    shutil.copytree(source, into)
    for name, old, new, _why in RELAXED:
        path = into / name
        text = path.read_text()
        assert text.count(old) == 1, f"{name}: the assertion to relax is not there once: {old!r}"
        path.write_text(text.replace(old, new))
    return into


@pytest.fixture(scope="module")
def report(smollm2_model_dir: Path, tmp_path_factory) -> ET.Element:
    tests = relaxed_copy(fetch_tests(shared.test_cache_dir()), tmp_path_factory.mktemp("llamacpp") / "tests")
    junit = tests / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(tests)]),
        "SIMMER_SHIM_MODEL_DIR": str(smollm2_model_dir),
        "SIMMER_SHIM_HOME": str(tmp_path_factory.mktemp("llamacpp-homes")),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *FILES, *PYTEST_ARGS, f"--junitxml={junit}"],
        cwd=tests,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert junit.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    root = ET.parse(junit).getroot()
    root.set("output", run.stdout[-6000:] + run.stderr[-2000:])
    return root


def cases(report: ET.Element) -> dict[str, tuple[str, str]]:
    """classname::name -> (outcome, message)."""
    out = {}
    for case in report.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome, message = kind, node.get("message", "")
        out[name] = (outcome, message)
    return out


@pytest.mark.slow
def test_llamacpp_server_tests_when_run_against_simmer_then_every_applicable_case_passes(report) -> None:
    results = cases(report)
    failed = {
        name: message for name, (outcome, message) in results.items() if outcome in ("failure", "error")
    }
    assert not failed, f"{failed}\n{report.get('output')}"
    skipped = {name: message for name, (outcome, message) in results.items() if outcome == "skipped"}
    # every skip is a not-applicable case with its reason (or one llama.cpp skips itself)
    reasons = set(NOT_APPLICABLE.values())
    for name, message in skipped.items():
        applies = (
            message.startswith("not applicable: ") and message.removeprefix("not applicable: ") in reasons
        )
        assert applies or "fails on linux" in message, (name, message)
    passed = [name for name, (outcome, _) in results.items() if outcome == "passed"]
    # as many cases as the selection had when this was written pass (a smaller number: cases went away)
    assert len(passed) >= APPLICABLE, (len(passed), len(skipped))


APPLICABLE = (
    34  # of 135 cases in FILES; the other 101 are not applicable (one is skipped by llama.cpp itself)
)
