"""docs/architecture.md matches the code: every module or folder path it names exists, and every module of
server/ (its package markers aside) is named there, so a move or a new module updates the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# a path in backticks that starts at one of the packages: `server/serving/worker.py`, `server/api/openai/`
NAMED = re.compile(r"`((?:server|models|governor)/[\w/]*?(?:\.py|/))`")


def named() -> list[str]:
    return NAMED.findall(DOC.read_text())


def test_architecture_doc_when_read_then_every_path_it_names_exists() -> None:
    paths = named()
    assert len(paths) > 40  # the page names the modules, not a few of them
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_architecture_doc_when_server_has_a_module_then_the_page_places_it() -> None:
    paths = set(named())
    folders = {p for p in paths if p.endswith("/")}
    modules = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "server").rglob("*.py")
        if p.name != "__init__.py" and "static" not in p.parts
    )
    unplaced = [m for m in modules if m not in paths and not any(m.startswith(f) for f in folders)]
    assert unplaced == [], "place these modules in docs/architecture.md"
