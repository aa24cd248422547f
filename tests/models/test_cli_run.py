"""`simmer run` and `simmer chat` on a tiny model installed from a local GGUF through the real store."""

from __future__ import annotations

import io

import pytest

from server.cli import main


@pytest.fixture
def installed_tiny(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SIMMER_HOME", str(tmp_path / "home"))
    assert main(["pull", str(tiny_gguf)]) == 0
    return tiny_gguf.stem.lower()


def test_run_when_prompt_then_reply_streamed_to_stdout(installed_tiny, capsys):
    code = main(["run", "--model", installed_tiny, "--max-tokens", "8", "--stats", "hello", "there"])
    out = capsys.readouterr()
    assert code == 0
    assert out.out.endswith("\n")
    assert "tok/s decode" in out.err and "prompt tokens" in out.err


def test_chat_when_two_turns_then_second_reuses_the_cache(installed_tiny, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("first question\nsecond question\n\n"))
    code = main(["chat", "--model", installed_tiny, "--max-tokens", "6", "--stats"])
    err = capsys.readouterr().err
    assert code == 0
    cached = [int(line.split("(")[1].split()[0]) for line in err.splitlines() if "cached)" in line]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0


def test_run_when_model_not_installed_then_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SIMMER_HOME", str(tmp_path / "empty"))
    assert main(["run", "hi"]) == 1
    assert "not installed" in capsys.readouterr().err


def test_run_when_base_model_then_prompt_continued_as_text(tiny_base_model_dir, capsys):
    """No chat template: `simmer run` continues the text instead of failing (or guessing a template)."""
    from argparse import Namespace

    from models.runtime.engine import load_engine
    from server.cli_run import _stream

    engine = load_engine(tiny_base_model_dir, variant="q4", threads=1, context_length=128)
    args = Namespace(max_tokens=4, temperature=0.0, top_p=1.0, seed=None, stats=True)
    _stream(engine, [{"role": "user", "content": "the cat"}], args)
    err = capsys.readouterr().err
    assert f"{len(engine.text_prompt('the cat').ids)} prompt tokens" in err
