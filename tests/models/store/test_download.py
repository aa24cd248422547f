"""Resumable downloads against a local HTTP server that drops connections, ignores ranges, changes the
file and answers 416; and the Hugging Face Hub source on top of them (redirect, sha256, token, errors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from models.errors import HashMismatch, InvalidModelFile, ModelNotFound, SourceUnavailable
from models.store.download import Download, Http
from models.store.hub import HubConfig, HuggingFaceFile
from tests.models.fileserver import FileServer, Served, sha

ROOT = Path(__file__).resolve().parents[3]
DATA = b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + os.urandom(300_000)
HALF = len(DATA) // 2


def download(server: FileServer, dest: Path, **kw) -> Download:
    args = {"retries": 3, "sleep": lambda s: None, "http": Http(timeout=10)}
    return Download(server.url("/f.gguf"), dest, **{**args, **kw})


def ranges(server: FileServer) -> list[str | None]:
    return [r.get("Range") for r in server.requests if r["method"] == "GET"]


def test_download_when_connection_drops_halfway_then_resumed_with_range(tmp_path: Path) -> None:
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF]) as server:
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA and got.sha256 == sha(DATA)
        assert ranges(server) == [None, f"bytes={HALF}-"]
        assert server.requests[-1]["If-Range"] == '"v1"'
        assert server.sent == len(DATA)  # nothing was sent twice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.gguf"]  # the lock file goes with its holder


def test_download_when_interrupted_and_no_retries_left_then_partial_kept_and_next_run_resumes(
    tmp_path: Path,
) -> None:
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF]) as server:
        with pytest.raises(SourceUnavailable, match=rf"interrupted .*{HALF} bytes are kept"):
            download(server, tmp_path / "f.gguf", retries=0).run()
        assert (tmp_path / "f.gguf.partial").stat().st_size == HALF
        assert json.loads((tmp_path / "f.gguf.partial.json").read_text())["validator"] == '"v1"'
        got = download(server, tmp_path / "f.gguf").run()  # a new pull, as after a restart
        assert got.path.read_bytes() == DATA
        assert ranges(server) == [None, f"bytes={HALF}-"] and server.sent == len(DATA)


def test_download_when_process_killed_mid_body_then_next_process_resumes(tmp_path: Path) -> None:
    stall = threading.Event()
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF], stall=stall) as server:
        script = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3])\n"
            "from models.store.download import Download, Http\n"
            "Download(sys.argv[1], Path(sys.argv[2]), Http(timeout=60), retries=0).run()\n"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", script, server.url("/f.gguf"), str(tmp_path / "f.gguf"), str(ROOT)]
        )
        partial = tmp_path / "f.gguf.partial"
        deadline = time.monotonic() + 30
        while not (partial.exists() and partial.stat().st_size == HALF) and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        stall.set()
        assert partial.stat().st_size == HALF
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA and ranges(server)[-1] == f"bytes={HALF}-"


def test_download_when_server_ignores_range_then_restarts_from_zero(tmp_path: Path) -> None:
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF], ignore_range=True) as server:
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA
        assert ranges(server) == [None, f"bytes={HALF}-"]  # asked, got a 200 with everything
        assert server.sent == HALF + len(DATA)


def test_download_when_file_changed_between_tries_then_if_range_restarts_with_new_file(
    tmp_path: Path,
) -> None:
    new = DATA[:-5] + b"NEW!!"
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF]) as server:
        with pytest.raises(SourceUnavailable):
            download(server, tmp_path / "f.gguf", retries=0).run()
        server.files["/f.gguf"] = Served(new, etag='"v2"', last_modified="Tue, 02 Jan 2024 00:00:00 GMT")
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == new
        assert server.requests[-1]["If-Range"] == '"v1"'  # the old validator: the server answers 200


def test_download_when_file_changed_and_sha_pinned_then_hash_mismatch_and_partial_dropped(
    tmp_path: Path,
) -> None:
    with FileServer({"/f.gguf": Served(DATA)}, drop_after=[HALF]) as server:
        with pytest.raises(SourceUnavailable):
            download(server, tmp_path / "f.gguf", retries=0).run()
        server.files["/f.gguf"] = Served(DATA[::-1], etag='"v2"')
        with pytest.raises(HashMismatch, match=f"expected {sha(DATA)}"):
            download(server, tmp_path / "f.gguf", expected_sha256=sha(DATA)).run()
    assert not (tmp_path / "f.gguf.partial").exists() and not (tmp_path / "f.gguf").exists()


def test_download_when_partial_already_complete_then_416_finishes_without_a_body(tmp_path: Path) -> None:
    (tmp_path / "f.gguf.partial").write_bytes(DATA)
    meta = {"url": None, "validator": '"v1"', "size": len(DATA)}
    with FileServer({"/f.gguf": Served(DATA)}) as server:
        meta["url"] = server.url("/f.gguf")
        (tmp_path / "f.gguf.partial.json").write_text(json.dumps(meta))
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA and server.sent == 0
        assert ranges(server) == [f"bytes={len(DATA)}-"]


def test_download_when_416_and_partial_longer_than_file_then_starts_again(tmp_path: Path) -> None:
    (tmp_path / "f.gguf.partial").write_bytes(DATA + b"junk")
    with FileServer({"/f.gguf": Served(DATA)}) as server:
        meta = {"url": server.url("/f.gguf"), "validator": '"v1"', "size": None}
        (tmp_path / "f.gguf.partial.json").write_text(json.dumps(meta))
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA
        assert ranges(server) == [f"bytes={len(DATA) + 4}-", None]


def test_download_when_server_gives_no_validator_then_partial_not_resumed(tmp_path: Path) -> None:
    served = Served(DATA, etag=None, last_modified=None)
    with FileServer({"/f.gguf": served}, drop_after=[HALF]) as server:
        got = download(server, tmp_path / "f.gguf").run()
        assert got.path.read_bytes() == DATA
        assert ranges(server) == [None, None]  # without a validator a range could splice two files


def test_download_when_only_last_modified_then_it_is_the_validator(tmp_path: Path) -> None:
    served = Served(DATA, etag='W/"weak"')  # weak ETags are not allowed in If-Range
    with FileServer({"/f.gguf": served}, drop_after=[HALF]) as server:
        assert download(server, tmp_path / "f.gguf").run().path.read_bytes() == DATA
        assert server.requests[-1]["If-Range"] == served.last_modified


def test_download_when_every_try_drops_then_gives_up_after_retries_with_backoff(tmp_path: Path) -> None:
    waits: list[float] = []
    server = FileServer({"/f.gguf": Served(DATA)}, drop_after=[1000] * 4)
    with server, pytest.raises(SourceUnavailable, match="after 4 tries; 4000 bytes are kept"):
        download(server, tmp_path / "f.gguf", retries=3, sleep=waits.append, backoff_s=0.5).run()
    assert waits == [0.5, 1.0, 2.0]


# ---- the Hugging Face Hub source ---------------------------------------------------------------------


def hub_file(server: FileServer, **kw) -> HuggingFaceFile:
    hub = HubConfig(endpoint=server.url(""), token="hf_secret", token_file=None, retries=3)
    return HuggingFaceFile(**{"repo": "owner/repo", "filename": "model.gguf", "hub": hub, **kw})


RESOLVE = "/owner/repo/resolve/main/model.gguf"


def test_hub_when_lfs_file_then_redirect_followed_sha_checked_and_token_kept_to_the_hub(
    tmp_path: Path,
) -> None:
    with FileServer(
        {"/cdn/model.gguf": Served(DATA)}, drop_after=[HALF], linked_etag={RESOLVE: f'"{sha(DATA)}"'}
    ) as server:
        got = hub_file(server).fetch(tmp_path)
        assert got.path == tmp_path / "hf" / "owner" / "repo" / "main" / "model.gguf"
        assert got.path.read_bytes() == DATA
        hub = [r for r in server.requests if r["path"] == RESOLVE]
        cdn = [r for r in server.requests if r["path"] == "/cdn/model.gguf"]
        assert all(r["Authorization"] == "Bearer hf_secret" for r in hub)
        assert all("Authorization" not in r for r in cdn) and len(cdn) == 2
        assert cdn[-1]["Range"] == f"bytes={HALF}-" and "Range" in hub[-1]  # the range follows the redirect


def test_hub_when_bytes_disagree_with_x_linked_etag_then_hash_mismatch(tmp_path: Path) -> None:
    server = FileServer({"/cdn/model.gguf": Served(DATA)}, linked_etag={RESOLVE: f'"{"a" * 64}"'})
    with server, pytest.raises(HashMismatch, match="the sha256 the server gives"):
        hub_file(server).fetch(tmp_path)
    assert not any(p.suffix == ".gguf" for p in tmp_path.rglob("*"))


def test_hub_when_cached_then_head_revalidates_and_changed_file_is_downloaded_again(tmp_path: Path) -> None:
    with FileServer({"/cdn/model.gguf": Served(DATA)}, linked_etag={RESOLVE: f'"{sha(DATA)}"'}) as server:
        first = hub_file(server).fetch(tmp_path)
        n = len(server.requests)
        assert hub_file(server).fetch(tmp_path) == first
        assert [r["method"] for r in server.requests[n:]] == ["HEAD", "HEAD"]  # hub + cdn, no body
        new = DATA[:-1] + b"!"
        server.files["/cdn/model.gguf"] = Served(new, etag='"v2"')
        server.linked_etag[RESOLVE] = f'"{sha(new)}"'
        assert hub_file(server).fetch(tmp_path).path.read_bytes() == new


def test_hub_when_offline_then_cached_file_used_without_requests_else_clear_error(tmp_path: Path) -> None:
    with FileServer({"/cdn/model.gguf": Served(DATA)}, linked_etag={RESOLVE: f'"{sha(DATA)}"'}) as server:
        offline = HubConfig(endpoint=server.url(""), offline=True, token_file=None)
        with pytest.raises(SourceUnavailable, match=r"owner/repo/model\.gguf .*offline mode is on"):
            HuggingFaceFile("owner/repo", "model.gguf", hub=offline).fetch(tmp_path)
        assert server.requests == []
        hub_file(server).fetch(tmp_path)
        n = len(server.requests)
        got = HuggingFaceFile("owner/repo", "model.gguf", hub=offline).fetch(tmp_path)
        assert got.path.read_bytes() == DATA and len(server.requests) == n


def test_hub_when_unreachable_then_source_unavailable_at_once(tmp_path: Path) -> None:
    with FileServer() as server:
        endpoint = server.url("")
    hub = HubConfig(endpoint=endpoint, token_file=None, retries=5)
    with pytest.raises(SourceUnavailable, match=rf"cannot reach the server .*Hugging Face Hub at {endpoint}"):
        HuggingFaceFile("owner/repo", "model.gguf", hub=hub).fetch(tmp_path)


@pytest.mark.parametrize(
    ("status", "headers", "error", "message"),
    [
        (404, {"X-Error-Code": "EntryNotFound"}, ModelNotFound, r"owner/repo/model\.gguf was not found"),
        (401, {"X-Error-Code": "RepoNotFound"}, ModelNotFound, "a private repo needs HF_TOKEN"),
        (403, {"X-Error-Code": "GatedRepo"}, SourceUnavailable, "owner/repo is gated .* set HF_TOKEN"),
        (500, {}, SourceUnavailable, r"cannot download owner/repo/model\.gguf: HTTP 500"),
    ],
)
def test_hub_when_error_status_then_clear_error(tmp_path: Path, status, headers, error, message) -> None:
    with FileServer(errors={RESOLVE: (status, headers)}) as server, pytest.raises(error, match=message):
        hub_file(server).fetch(tmp_path)


def test_hub_when_not_a_gguf_then_invalid_file_and_not_cached(tmp_path: Path) -> None:
    server = FileServer({"/cdn/model.gguf": Served(b"<html>login</html>" * 10)})
    with server, pytest.raises(InvalidModelFile, match="not a GGUF"):
        hub_file(server).fetch(tmp_path)
    assert not (tmp_path / "hf" / "owner" / "repo" / "main" / "model.gguf").exists()


def test_hub_when_revision_and_subfolder_then_resolve_url_quotes_them() -> None:
    src = HuggingFaceFile("o/r", "sub dir/m.gguf", revision="refs/pr/1", hub=HubConfig(endpoint="http://h/"))
    assert src.url == "http://h/o/r/resolve/refs%2Fpr%2F1/sub%20dir/m.gguf"


def test_cli_pull_when_hf_model_then_downloaded_from_the_configured_hub_and_installed(
    tmp_path, capsys
) -> None:
    from server.cli import main as cli
    from server.settings import Settings
    from tests.models.store.helpers import FakeConverter

    with FileServer({"/cdn/model.gguf": Served(DATA)}, linked_etag={RESOLVE: f'"{sha(DATA)}"'}) as server:
        settings = Settings(home=tmp_path / "home", hf_endpoint=server.url(""), hf_token="hf_from_settings")
        code = cli.main(
            ["pull", "hf:owner/repo/model.gguf"], settings=settings, converter=FakeConverter().as_converter()
        )
        assert code == 0, capsys.readouterr().err
        assert server.requests[0]["Authorization"] == "Bearer hf_from_settings"
    manifest = json.loads(next((tmp_path / "home" / "models" / "model").glob("*/manifest.json")).read_text())
    assert manifest["source"]["url"] == server.url(RESOLVE) and manifest["source"]["sha256"] == sha(DATA)
