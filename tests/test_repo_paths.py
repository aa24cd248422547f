"""No file in the repository names a path outside it: a reader of a clone must find everything it points at.

Forbidden: the design notes' folder (`../shared`, `shared/design`), this machine's work and home folders
(`/work/`, `/root/`, `/home/<user>`, `/Users/`), a Markdown document that is not in the repository, and a
Markdown link whose target (or heading anchor) does not exist.
Allowed: the container's own home (`/home/simmer`, in docker/), scratch paths under /tmp in scripts and
recorded benchmark results, and `~/.cache/simmer` (the documented default of SIMMER_HOME).

And no file cites this project's issue numbers: a comment or a doc says what the code does, not which issue
asked for it. Another project's issue is a fact's source and may be cited with the project's name
("Ollama issue 17916").
"""

from __future__ import annotations

import posixpath
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
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")
# projects whose issue trackers a comment may cite as the source of a fact
EXTERNAL = re.compile(
    r"\b(Ollama|psutil|onnxruntime(-genai)?|llama\.cpp|llama-cpp-python|transformers|vLLM|SGLang|"
    r"tokenizers|llguidance|xgrammar|pydantic|FastAPI|Starlette|uvicorn|httpx|CPython|glibc|Linux)"
    r"('s)?( GitHub)?\s*$",
    re.IGNORECASE,
)


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
                if doc.startswith(("../", "./")):  # relative to the file that names it
                    doc = posixpath.normpath(posixpath.join(posixpath.dirname(rel), doc))
                if doc not in markdown and not (("/" not in doc) and doc in basenames):
                    problems.append(f"{rel}:{n}: names {doc}, which is not in the repository")
    assert not problems, "\n".join(problems)


def test_scan_when_outside_paths_then_caught() -> None:
    """The patterns themselves: what must be caught and what must pass."""
    for bad in ("See /work/shared/design/THERMAL_SIM.md", "../shared/x", "/root/.cache/x", "/home/alice/x"):
        assert OUTSIDE.search(bad) or MARKDOWN.search(bad), bad
    assert MARKDOWN.findall("design in THERMAL_SIM.md): one") == ["THERMAL_SIM.md"]
    assert MARKDOWN.findall("see docs/readme/docker.md") == ["docs/readme/docker.md"]
    assert MARKDOWN.findall("[index](../studies/README.md#index)") == ["../studies/README.md"]
    for fine in ("WORKDIR /home/simmer", "default `~/.cache/simmer`", "mktemp -d /tmp/simmer.XXXX"):
        assert not OUTSIDE.search(fine), fine


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(rel: str, markdown: str, exists, anchors_of) -> list[str]:
    """The relative links of one Markdown file whose file or heading anchor does not exist."""
    problems = []
    fenced = False
    for n, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (Path(rel).parent / path).as_posix() if path else rel
            resolved = Path(resolved).as_posix()
            parts: list[str] = []
            for part in resolved.split("/"):
                if part == "..":
                    if parts:
                        parts.pop()
                elif part not in (".", ""):
                    parts.append(part)
            resolved = "/".join(parts)
            if not exists(resolved):
                problems.append(f"{rel}:{n}: links {target}, which is not in the repository")
            elif fragment and resolved.endswith(".md") and fragment not in anchors_of(resolved):
                problems.append(f"{rel}:{n}: links {target}, a heading {resolved} does not have")
    return problems


def test_markdown_when_scanned_then_every_link_resolves() -> None:
    files = repo_files()
    rels = {p.relative_to(ROOT).as_posix() for p in files}
    dirs = {"/".join(r.split("/")[:i]) for r in rels for i in range(1, r.count("/") + 1)}
    problems = []
    for path in files:
        if path.suffix != ".md":
            continue
        rel = path.relative_to(ROOT).as_posix()
        problems += broken_links(
            rel,
            path.read_text(),
            lambda r: r in rels or r in dirs,
            lambda r: anchors((ROOT / r).read_text()),
        )
    assert not problems, "\n".join(problems)


def test_links_when_broken_then_caught() -> None:
    text = "# Top\n## A heading (`x.py`)\n[ok](b.md#other) [ok](#a-heading-xpy) [bad](#nope) [gone](c.md)\n"
    files = {"docs/a.md": text, "docs/b.md": "## Other\n"}
    found = broken_links("docs/a.md", text, lambda r: r in files, lambda r: anchors(files[r]))
    assert found == [
        "docs/a.md:3: links #nope, a heading docs/a.md does not have",
        "docs/a.md:3: links c.md, which is not in the repository",
    ]
    assert broken_links("README.md", "[up](docs/b.md) ```[x](y)```", lambda r: r in files, anchors) == []


def issue_citations(text: str) -> list[str]:
    """This project's issue numbers cited in a text (another project's, named just before, pass)."""
    return [m.group(0) for m in ISSUE.finditer(text) if not EXTERNAL.search(text[: m.start()])]


def test_repo_when_scanned_then_no_file_cites_an_issue_number() -> None:
    problems = []
    for path in repo_files():
        if path.resolve() == THIS_FILE:
            continue
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(text.splitlines(), 1):
            if issue_citations(line):
                problems.append(f"{rel}:{n}: {line.strip()}")
    assert not problems, "say what the code does, not which issue asked for it:\n" + "\n".join(problems)


def test_issue_scan_when_cited_then_caught_unless_another_project() -> None:
    for bad in (
        "(issue 13)",
        "Issue 11, defect 4",
        "issues #12",
        "see issue #7 item 3",
        "for Issue 16's targets",
    ):
        assert issue_citations(bad), bad
    for fine in (
        "the 45x slowdown of Ollama issue 17916",
        "(psutil issue 2100)",
        "llama.cpp issue #1234",
        "onnxruntime's issue 20000",
        "an issue with 3 tokens",
        "no issues",
    ):
        assert not issue_citations(fine), fine
