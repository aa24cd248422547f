"""No module of the product imports another module's private name (`from x import _y`): what one module
needs of another is public there, so a module's private names can change without breaking a neighbour."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "models", "governor")


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, `module._name`) of every `from module import _name` in `source` (dunders are public)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = "." * node.level + (node.module or "")
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                found.append((node.lineno, f"{module}{'' if module.endswith('.') else '.'}{name}"))
    return found


def test_private_imports_when_a_module_imports_another_modules_private_name_then_found() -> None:
    source = "from a.b import _hidden, shown\nfrom . import _sibling\nfrom c import __version__\n"
    assert private_imports(source) == [(1, "a.b._hidden"), (2, "._sibling")]


def test_imports_when_read_then_no_module_imports_a_private_name_of_another() -> None:
    seen = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in private_imports(path.read_text())
    ]
    assert seen == [], "make these names public where they are defined:\n" + "\n".join(seen)


def _is_test_module(name: str) -> bool:
    """A test file's module (tests/.../test_x.py), not a name in a module (conftest's test_cache_dir)."""
    parts = name.split(".")
    return (
        parts[0] == "tests"
        and parts[-1].startswith("test_")
        and ROOT.joinpath(*parts).with_suffix(".py").exists()
    )


def imports_of_tests(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a test module (`tests....test_x`) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in modules if _is_test_module(m)]
    return found


def test_test_imports_when_a_test_file_imports_another_then_found() -> None:
    source = "from tests.models.runtime.test_batch import x\nfrom tests.server.api import test_api\n"
    source += "from tests.helpers import sdk\nfrom tests.conftest import test_cache_dir\n"
    assert imports_of_tests(source) == [
        (1, "tests.models.runtime.test_batch"),
        (2, "tests.server.api.test_api"),
    ]


def test_imports_when_read_then_no_test_file_imports_another() -> None:
    """What several test files use lives in a helpers module or a conftest.py of their folder."""
    seen = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, name in imports_of_tests(path.read_text())
    ]
    assert seen == [], "move what these use to a helpers module:\n" + "\n".join(seen)
