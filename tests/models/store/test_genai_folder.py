"""`simmer pull ./folder` for onnxruntime-genai folders, and the engine's general path that serves them.

The folders are our converted tiny model re-exported the ways other exporters do
(tests/models/genai_folders.py): whatever the layout, the logits and the greedy output must equal our own
folder's on the fast path (fp16 KV and logits: within fp16's rounding).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from models.errors import InvalidModelFile, InvalidParameter, VerificationFailed
from models.protocol import Prompt
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.genai_config import DecoderIO
from models.runtime.session import DecoderSession, GeneralDecoderSession, GrowingKV, KVCache, SharedKV
from models.store.store import ModelStore
from models.types import GenerationParams, SamplingParams
from tests.models import genai_folders as gf

PROMPTS = ([1, 5, 17, 40, 33, 9], [7, 100, 200, 31, 5, 250, 11], [3])
GREEDY = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=12, ignore_eos=True)


def build(kind: str, model_dir: Path, dest: Path) -> Path:
    if kind == "shared":
        return gf.foreign_copy(model_dir, dest, share_buffer=True)
    # fp16 on the fp32 decoder: its errors are fp16's alone (int8 activations would amplify them)
    decoder = "f32.onnx" if kind == "fp16" else None
    folder = gf.foreign_copy(model_dir, dest, share_buffer=False, decoder=decoder)
    if kind == "all-positions":
        gf.all_position_logits(folder)
        gf.position_ids_input(folder)
    if kind == "fp16":
        gf.fp16_edges(folder)
    return folder


KINDS = ["shared", "separate", "all-positions", "fp16"]


@pytest.fixture(scope="module")
def store_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("genai-home")


@pytest.fixture(scope="module", params=KINDS)
def installed(request, tiny_model_dir, tmp_path_factory, store_home):
    kind = request.param
    folder = build(kind, tiny_model_dir, tmp_path_factory.mktemp("src") / f"foreign-{kind}")
    return kind, ModelStore(store_home).pull(str(folder))


@pytest.fixture(scope="module")
def ours(installed, tiny_model_dir) -> DecoderEngine:
    """Our own folder on the fast path, with the variant the foreign folder's decoder was made from."""
    decoder = installed[1].variants["genai"]["file"]
    return load_engine(tiny_model_dir, variant=Path(decoder).stem, threads=1, context_length=128)


def greedy(engine: DecoderEngine, ids: list[int]) -> list[int]:
    return [e.token_id for e in engine.generate(Prompt(list(ids)), GREEDY) if hasattr(e, "token_id")]


def test_folder_pull_when_genai_folder_then_manifest_from_its_config(installed) -> None:
    kind, model = installed
    (name,) = model.variants
    entry = model.variants[name]
    io = DecoderIO.from_dict(entry["genai"])
    assert (io.n_layers, io.n_kv_heads, io.head_dim, io.vocab, io.context_length) == (2, 2, 16, 288, 256)
    assert io.share_buffer == (kind == "shared") and io.eos_ids == (0, 2) and io.bos_id == 1
    assert io.position_ids == ("position_ids" if kind == "all-positions" else None)
    assert entry["file"] == io.filename and "weights.data" in entry["files"]
    assert model.manifest["source"]["kind"] == "genai-folder"
    assert "manifest.json" in [p.name for p in model.path.iterdir()]
    assert set(model.manifest["files"]) >= {
        io.filename,
        "weights.data",
        "tokenizer.json",
        "genai_config.json",
    }


def test_folder_engine_when_any_layout_then_greedy_equals_our_folder(installed, ours) -> None:
    kind, model = installed
    engine = DecoderEngine(model.path, model.manifest, threads=1, context_length=128)
    assert engine.io is not None and engine.io.share_buffer == (kind == "shared")
    for ids in PROMPTS:
        assert greedy(engine, ids) == greedy(ours, ids), ids


def test_folder_engine_when_prefix_reused_then_same_as_fresh(installed, ours) -> None:
    """A second prompt sharing a shorter prefix rewinds the foreign KV cache (a copy for separate buffers)."""
    _, model = installed
    engine = DecoderEngine(model.path, model.manifest, threads=1, context_length=128)
    first, second = [1, 5, 17, 40, 33, 9, 8, 8], [1, 5, 17, 99, 98]
    greedy(engine, first)
    assert greedy(engine, second) == greedy(ours, second)


def test_general_session_when_any_layout_then_logits_match_the_fast_path(installed, tiny_model_dir) -> None:
    kind, model = installed
    io = DecoderIO.from_dict(model.variants["genai"]["genai"])
    general = GeneralDecoderSession(model.path / io.filename, io, 1)
    fast = DecoderSession(tiny_model_dir / io.filename, general.shape, 1)
    kv, ref_kv = general.new_cache(64), KVCache(fast.shape, 64)  # each its own session's KV type
    assert isinstance(kv, SharedKV if kind == "shared" else GrowingKV)
    assert kv.arrays[0][0].dtype == np.float32 if kind == "shared" else kv.dtype == general.kv_dtype
    got, want = general.run(np.array(PROMPTS[1]), kv, 0), fast.run(np.array(PROMPTS[1]), ref_kv, 0).copy()
    # fp16 keys, values and logits: about 3 significant digits
    tol = 5e-3 * float(np.abs(want).max()) if kind == "fp16" else 1e-5
    np.testing.assert_allclose(got, want, atol=tol)
    pos = len(PROMPTS[1])
    for _ in range(6):
        token = np.array([int(want.argmax())])
        got, want = general.run(token, kv, pos), fast.run(token, ref_kv, pos).copy()
        np.testing.assert_allclose(got, want, atol=tol)
        assert got.argmax() == want.argmax()
        pos += 1


def test_general_session_when_fp16_then_kv_and_logits_follow_the_session(installed) -> None:
    kind, model = installed
    io = DecoderIO.from_dict(model.variants["genai"]["genai"])
    sess = GeneralDecoderSession(model.path / io.filename, io, 1)
    assert sess.kv_dtype == (np.float16 if kind == "fp16" else np.float32)
    kv = sess.new_cache(16)
    logits = sess.run(np.array([1, 2, 3]), kv, 0)
    assert logits.dtype == np.float32 and logits.shape == (io.vocab,)
    if isinstance(kv, GrowingKV):
        assert kv.length == 3 and kv.values[0][0].numpy().dtype == sess.kv_dtype


def test_folder_pull_when_pulled_again_then_already_installed(installed, store_home) -> None:
    _, model = installed
    source = model.manifest["source"]["path"]
    again = ModelStore(store_home).pull(source)
    assert again.version == model.version


# ---- bad folders -----------------------------------------------------------------------------------


def nothing_installed(home: Path) -> bool:
    return ModelStore(home).list() == []


def test_folder_pull_when_no_genai_config_then_clear_error(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.onnx").write_bytes(b"x")
    with pytest.raises(InvalidModelFile, match=r"no genai_config\.json: not an onnxruntime-genai folder"):
        ModelStore(tmp_path / "home").pull(str(tmp_path / "plain"))
    assert nothing_installed(tmp_path / "home")


def test_folder_pull_when_config_names_a_missing_decoder_then_clear_error(tiny_model_dir, tmp_path) -> None:
    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "f")
    decoder = gf.decoder_path(folder)
    decoder.unlink()
    # the decoder genai_config.json names is the nominal variant's, which the machine's measured quality
    # chose (q4 where int8 activations lose more, as on arm64)
    with pytest.raises(InvalidModelFile, match=rf"has genai_config.json but no {re.escape(decoder.name)}"):
        ModelStore(tmp_path / "home").pull(str(folder))
    assert nothing_installed(tmp_path / "home")


def test_folder_pull_when_config_lacks_a_field_then_names_it(tiny_model_dir, tmp_path) -> None:
    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "f")
    cfg = json.loads((folder / "genai_config.json").read_text())
    del cfg["model"]["decoder"]["head_size"]
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        InvalidModelFile, match=r"genai_config\.json is missing or has a bad value for 'head_size'"
    ):
        ModelStore(tmp_path / "home").pull(str(folder))


def test_folder_pull_when_io_names_wrong_then_smoke_test_fails_and_nothing_installed(
    tiny_model_dir, tmp_path
):
    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "f")
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerificationFailed, match=r"has no past\.0\.k, past\.1\.k"):
        ModelStore(tmp_path / "home").pull(str(folder))
    assert nothing_installed(tmp_path / "home")


def test_folder_pull_when_other_variants_asked_then_invalid_parameter(tiny_model_dir, tmp_path) -> None:
    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "f")
    with pytest.raises(InvalidParameter, match="installed as is: its one variant is 'genai'"):
        ModelStore(tmp_path / "home").pull(str(folder), variants=["q4"])
    assert nothing_installed(tmp_path / "home")


def test_folder_pull_when_a_file_changes_during_the_copy_then_verification_fails(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    from models.store import folder as folder_mod
    from models.store import registry

    src = gf.foreign_copy(tiny_model_dir, tmp_path / "f")
    real_copy = folder_mod.copy_folder

    def copy_then_change(*args, **kwargs):
        (src / "tokenizer_config.json").write_text("{}")  # after hashing, before the copy
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(
        folder_mod, "FOLDER_INSTALLER", replace(folder_mod.FOLDER_INSTALLER, convert=copy_then_change)
    )
    monkeypatch.setattr(registry, "FOLDER_INSTALLER", folder_mod.FOLDER_INSTALLER)
    with pytest.raises(VerificationFailed, match="the folder changed while it was being copied"):
        ModelStore(tmp_path / "home").pull(str(src))
    assert nothing_installed(tmp_path / "home")


def test_registry_when_folder_path_then_folder_name_is_the_id(tiny_model_dir, tmp_path) -> None:
    from models.store import registry

    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "Phi-3.5-mini-int4")
    spec = registry.resolve(str(folder))
    assert spec.id == "phi-3.5-mini-int4" and spec.source.kind == "genai-folder"
    assert registry.model_id(str(folder) + "/") == "phi-3.5-mini-int4"
