"""The one way the store names a path it writes: `inside(root, *parts)`.

Names reach the store from requests and from sources (a model id, an `hf:` repo, revision and file name, a
wheel member), and the store deletes what does not check out. So every path it writes, renames or removes
is built here: each part must be a plain name (not empty, `.` or `..`, no separator, no NUL), and the
path, with every symlink resolved, must stay under the root (resolved too). Anything else is refused
before the file system is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.errors import InvalidParameter

SEPARATORS = ("/", "\\")


def plain_name(part: str, *, what: str, param: str | None = "model") -> str:
    """`part` when it names one entry of a folder; InvalidParameter otherwise."""
    if (
        not isinstance(part, str)
        or part in ("", ".", "..")
        or any(sep in part for sep in SEPARATORS)
        or "\x00" in part
    ):
        raise InvalidParameter(
            f"{what}: {part!r} is not a plain name (empty, '.', '..', a path separator or NUL)", param=param
        )
    return part


def plain_names(parts: list[str] | tuple[str, ...], *, what: str, param: str | None = "model") -> None:
    for part in parts:
        plain_name(part, what=what, param=param)


def inside(root: Path, *parts: str, what: str = "a store path", param: str | None = "model") -> Path:
    """root/part/part...: each part a plain name, and the result under root once symlinks are resolved."""
    plain_names(parts, what=what, param=param)
    path = Path(root).joinpath(*parts)
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(real_root):
        raise InvalidParameter(
            f"{what}: {Path(*parts) if parts else '.'} resolves outside {root} (a symlink): refused",
            param=param,
        )
    return path
