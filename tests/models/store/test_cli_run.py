"""`simmer run` and `simmer chat` on a tiny model installed from a local GGUF through the real store."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from server.cli.main import main


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
    # chunks shorter than the first turn: where passes depend on their size (ARM), reuse is in whole chunks
    monkeypatch.setenv("SIMMER_PREFILL_CHUNK", "4")
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
    from server.cli.run import _stream

    engine = load_engine(tiny_base_model_dir, variant="q4", threads=1, context_length=128)
    args = Namespace(max_tokens=4, temperature=0.0, top_p=1.0, seed=None, stats=True)
    _stream(engine, [{"role": "user", "content": "the cat"}], args)
    err = capsys.readouterr().err
    assert f"{len(engine.text_prompt('the cat').ids)} prompt tokens" in err


def test_chat_when_turns_dropped_then_summarized_while_the_user_types(installed_tiny, capsys, monkeypatch):
    """`simmer chat` keeps a summary of the turns its window drops, as the server does: written by the chat's
    model in a thread while the next line is typed (here: input() waits until that work is done)."""
    import time

    from server.cli import run as cli_run
    from server.serving.summary import Summarizer

    monkeypatch.setenv("SIMMER_CONTEXT_LENGTH", "160")
    made: list[Summarizer] = []

    class Recorded(Summarizer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # the tiny random model writes newlines or bytes that are no text greedily: ASCII only
            banned = [*range(0, 32), *range(127, 256)]
            self.sampling = replace(self.sampling, logit_bias=tuple((3 + b, -100.0) for b in banned))
            made.append(self)

    monkeypatch.setattr(cli_run, "Summarizer", Recorded)
    lines = iter([f"question {i}: " + "the cat sat on a mat " * 3 for i in range(6)] + [""])

    def typed(prompt: str = "") -> str:
        if made:  # the user types slowly: the summary work ends first
            deadline = time.monotonic() + 60
            while (made[0].pending() or made[0].running) and time.monotonic() < deadline:
                time.sleep(0.01)
        return next(lines)

    monkeypatch.setattr("builtins.input", typed)
    code = cli_run.cli_chat(["--model", installed_tiny, "--max-tokens", "6", "--stats"], cli_run.Settings())
    err = capsys.readouterr().err
    stats = [line for line in err.splitlines() if "tok/s decode" in line]
    assert code == 0 and len(stats) == 6
    assert "truncated" not in stats[0] and any("truncated" in s for s in stats)
    assert made[0].written >= 1 and any("summarized" in s for s in stats)


def test_chat_when_summary_off_then_plain_window(installed_tiny, capsys, monkeypatch):
    from server.cli import run as cli_run

    monkeypatch.setenv("SIMMER_CONTEXT_LENGTH", "160")
    monkeypatch.setenv("SIMMER_SUMMARY", "false")
    lines = iter([f"question {i}: " + "the cat sat on a mat " * 3 for i in range(4)] + [""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert (
        cli_run.cli_chat(["--model", installed_tiny, "--max-tokens", "6", "--stats"], cli_run.Settings()) == 0
    )
    stats = [line for line in capsys.readouterr().err.splitlines() if "tok/s decode" in line]
    assert any("truncated" in s for s in stats) and not any("summarized" in s for s in stats)
