"""Facts a load measures about how this machine's kernels run a model file (session.py's probes), kept
beside the file in `measured.json` so that the next load on the same machine reads them instead of running
the probes again: for a 0.5B model they cost about as much as the rest of its load.

Only in the store's version folders (those it verified: verified.json): simmer writes nothing into a folder
outside its store, so a model loaded from elsewhere keeps its facts for the process only.

A fact is keyed by everything its arithmetic depends on: the file (name, size, modification time), the CPU
(the architecture and what /proc/cpuinfo says of the first core: model and instruction-set extensions),
onnxruntime's version and the thread count. Another machine, a new onnxruntime or another thread count
measures again. A store that cannot be written (read-only) keeps them for the process only too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import onnxruntime as ort

from models.store import integrity
from models.store.durable import replace_text

MEASURED = "measured.json"
SCHEMA = 1
# The /proc/cpuinfo fields that name a core and its instruction sets, on x86 and on ARM.
CPU_FIELDS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")

_process: dict[str, Any] = {}  # what this process measured or read, by path and key


@cache
def cpu_signature(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The architecture and the first core's CPU_FIELDS (what the kernels onnxruntime picks depend on)."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if not line.strip() and fields:
            break  # the first core's block is enough: the kernels are chosen once
        name, _, value = line.partition(":")
        if name.strip() in CPU_FIELDS:
            fields.setdefault(name.strip(), " ".join(sorted(value.split())))
    return "|".join([platform.machine(), *(f"{k}={fields[k]}" for k in sorted(fields))])


def fact_key(path: Path, threads: int, name: str) -> str:
    """What `name`'s value depends on: the file, onnxruntime's version, the thread count and the CPU (its
    architecture, and a digest of the rest of cpu_signature: the flags alone run to 1.5 kB on x86)."""
    st = path.stat()
    arch, _, rest = cpu_signature().partition("|")
    cpu = hashlib.sha256(rest.encode()).hexdigest()[:16]
    file = f"{path.name}|{st.st_size}|{st.st_mtime_ns}"
    return f"{name}|{file}|ort={ort.__version__}|threads={threads}|{arch}:{cpu}"


def remembered(
    path: Path, threads: int, name: str, measure: Callable[[], Any], valid: Callable[[Any], bool]
) -> Any:
    """The fact `name` about sessions of the model file `path` with `threads` on this machine: read from
    `measured.json` beside it if `valid`, else `measure()`d (a JSON value) and written there if the store
    owns the folder."""
    key = fact_key(path, threads, name)
    memo = f"{path.resolve()}\0{key}"
    if memo in _process:
        return _process[memo]
    facts = _read(path.parent / MEASURED)
    if key in facts and valid(facts[key]):
        value = facts[key]
    else:
        value = measure()
        if (path.parent / integrity.VERIFIED).exists():
            _write(path.parent / MEASURED, {**_read(path.parent / MEASURED), key: value})
    _process[memo] = value
    return value


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("facts"), dict):
        return {}
    return data["facts"]


def _write(file: Path, facts: dict[str, Any]) -> None:
    """Atomic, not fsynced: losing it costs one more measurement. A folder that cannot be written is not an
    error."""
    with contextlib.suppress(OSError):
        replace_text(file, json.dumps({"schema": SCHEMA, "facts": facts}, indent=1, sort_keys=True) + "\n")
