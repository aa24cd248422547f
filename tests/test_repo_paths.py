"""No file in the repository names a path outside it: a reader of a clone must find everything it points at.

Forbidden: the design notes' folder (`../shared`, `shared/design`), this machine's work and home folders
(`/work/`, `/root/`, `/home/<user>`, `/Users/`), and a Markdown document that is not in the repository.
Allowed: the container's own home (`/home/simmer`, in docker/), scratch paths under /tmp in scripts and
recorded benchmark results, and `~/.cache/simmer` (the documented default of SIMMER_HOME).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist", "artifacts"}
OUTSIDE = re.compile(r"\.\./shared\b|shared/design|/work/|/root/|/home/(?!simmer\b)[A-Za-z_]|/Users/")
MARKDOWN = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
THIS_FILE = Path(__file__).resolve()
# Markdown names that are data, not references: members of gemma3-270m's meta wheel (models/store/registry.py)
NOT_REFERENCES = {"NOTICE.md", "README.upstream.md"}


def repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), or a walk when this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)
        ]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        return None  # binary (images, plots)
    return data.decode("utf-8", errors="replace")


def test_repo_when_scanned_then_no_file_names_a_path_outside_it() -> None:
    files = repo_files()
    assert len(files) > 50, "the scan found too few files to mean anything"
    markdown = {p.relative_to(ROOT).as_posix() for p in files if p.suffix == ".md"}
    basenames = {Path(m).name for m in markdown}
    problems = []
    for path in files:
        if path.resolve() == THIS_FILE:
            continue
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                problems.append(f"{rel}:{n}: {line.strip()}")
            for doc in MARKDOWN.findall(line):
                if doc in NOT_REFERENCES:
                    continue
                if doc not in markdown and not (("/" not in doc) and doc in basenames):
                    problems.append(f"{rel}:{n}: names {doc}, which is not in the repository")
    assert not problems, "\n".join(problems)


def test_scan_when_outside_paths_then_caught() -> None:
    """The patterns themselves: what must be caught and what must pass."""
    for bad in ("See /work/shared/design/THERMAL_SIM.md", "../shared/x", "/root/.cache/x", "/home/alice/x"):
        assert OUTSIDE.search(bad) or MARKDOWN.search(bad), bad
    assert MARKDOWN.findall("design in THERMAL_SIM.md): one") == ["THERMAL_SIM.md"]
    assert MARKDOWN.findall("see docs/readme/docker.md") == ["docs/readme/docker.md"]
    for fine in ("WORKDIR /home/simmer", "default `~/.cache/simmer`", "mktemp -d /tmp/simmer.XXXX"):
        assert not OUTSIDE.search(fine), fine
