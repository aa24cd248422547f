"""Rewrite a conversion's weights so that the variants kept reference one file holding only their bytes.

A pull builds the nominal variant's candidates into one shared weights file (exact initializers shared by
name) and a re-encoded variant's own file beside it, measures them, and keeps the nominal one alone
(convert/nominal.py). What the others wrote would be disk the device never reads, and the runtime gives
back the copied-at-load pages of the shared file only (session.release_copied). So the bytes the kept
graphs reference are moved into the shared file, in place and in file order (a range only ever moves to a
lower offset, so nothing is read after it was overwritten), then those of the other files are appended,
the file is cut where the last one ends and every initializer's location and offset is rewritten.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping
from pathlib import Path

import onnx

from models.convert.graph import ALIGN

CHUNK = 8 << 20  # bytes copied at a time


def _merged(spans: list[tuple[int, int]]) -> list[list[int]]:
    """Overlapping or touching [start, end) ranges joined (a row-slice alias lies inside its table)."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _copy(src, dst, src_pos: int, dst_pos: int, n: int) -> None:
    done = 0
    while done < n:
        src.seek(src_pos + done)
        chunk = src.read(min(CHUNK, n - done))
        if not chunk:
            raise RuntimeError("converter bug: a weights range ends beyond its file")
        dst.seek(dst_pos + done)
        dst.write(chunk)
        done += len(chunk)


def consolidate(
    out_dir: Path, shared: str, copied_by_file: Mapping[str, Mapping[str, list[list[int]]]]
) -> dict[str, list[list[int]]]:
    """Rewrite the .onnx of each variant named in `copied_by_file` ({variant: {file: [[offset, length]]}},
    the spans its kernels copy at load) so that all their initializers live in `shared`, which then holds
    nothing else; the other data files they referenced are removed. Returns each variant's copied spans in
    the new file."""
    graphs = {
        name: onnx.load(str(out_dir / f"{name}.onnx"), load_external_data=False) for name in copied_by_file
    }
    spans: dict[str, list[tuple[int, int]]] = {}
    for g in graphs.values():
        for t in g.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if ext:
                off, n = int(ext.get("offset", 0)), int(ext["length"])
                spans.setdefault(ext["location"], []).append((off, off + n))
    order = [shared, *sorted(loc for loc in spans if loc != shared)]
    ranges = {loc: _merged(spans.get(loc, [])) for loc in order}
    moved: dict[str, list[tuple[int, int, int]]] = {}  # location -> (old start, old end, new start)
    cursor = 0
    with open(out_dir / shared, "r+b") as dst:
        for loc in order:
            src = dst if loc == shared else open(out_dir / loc, "rb")  # noqa: SIM115 - closed below
            try:
                for start, end in ranges[loc]:
                    new = cursor + (-cursor) % ALIGN
                    if loc != shared or new != start:
                        _copy(src, dst, start, new, end - start)
                    moved.setdefault(loc, []).append((start, end, new))
                    cursor = new + end - start
            finally:
                if src is not dst:
                    src.close()
        dst.truncate(cursor)
        dst.flush()
        os.fsync(dst.fileno())

    def relocate(loc: str, off: int) -> int:
        table = moved[loc]
        i = bisect.bisect_right([m[0] for m in table], off) - 1
        start, end, new = table[i]
        if not start <= off < end or i < 0:
            raise RuntimeError(f"converter bug: offset {off} of {loc} lies in no range kept")
        return new + off - start

    for name, g in graphs.items():
        for t in g.graph.initializer:
            ext = {e.key: e for e in t.external_data}
            if ext:
                loc = ext["location"].value
                if "offset" not in ext:
                    entry = t.external_data.add()
                    entry.key, entry.value = "offset", "0"
                    ext["offset"] = entry
                ext["offset"].value = str(relocate(loc, int(ext["offset"].value)))
                ext["location"].value = shared
        path = out_dir / f"{name}.onnx"
        path.write_bytes(g.SerializeToString())
    for loc in order[1:]:
        (out_dir / loc).unlink(missing_ok=True)
    return {
        name: sorted([relocate(loc, off), n] for loc, file_spans in by_file.items() for off, n in file_spans)
        for name, by_file in copied_by_file.items()
    }
