"""Read a safetensors file into numpy arrays, with no dependency: the format is an 8-byte little-endian
header length, a JSON header (name -> dtype, shape, byte offsets into the data that follows) and the data.

The types an encoder checkpoint carries are read: floats (F32, F16, BF16) as float32, I64 (a BERT's
`position_ids` buffer) as int64; anything else, or a header whose offsets run past the file, is an
InvalidModelFile naming the tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from models.errors import InvalidModelFile

_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
}
# A header is names and shapes: a few hundred KB for the largest checkpoints; more is a wrong file.
_MAX_HEADER = 64 << 20


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file (floats as float32, F16 and BF16 widened exactly), copied out of the file."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise InvalidModelFile(f"{path} is not a safetensors file (shorter than its header length)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(_MAX_HEADER, len(data) - 8):
        raise InvalidModelFile(f"{path} is not a safetensors file (header length {length})")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as err:
        raise InvalidModelFile(f"{path}: unreadable safetensors header ({err})") from err
    base = 8 + length
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise InvalidModelFile(
                f"{path}: tensor {name} has dtype {meta.get('dtype')}; F32, F16, BF16 or I64 expected"
            )
        shape = tuple(int(d) for d in meta["shape"])
        start, end = (int(x) for x in meta["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= start <= end <= len(data) - base or end - start != count * dtype.itemsize:
            raise InvalidModelFile(f"{path}: tensor {name}'s offsets do not fit its shape or the file")
        raw = np.frombuffer(data, dtype=dtype, count=count, offset=base + start)
        if meta["dtype"] == "BF16":
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "I64":
            arr = raw.astype(np.int64)
        else:
            arr = raw.astype(np.float32)
        out[name] = arr.reshape(shape)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The F32 file a test writes (a tiny random checkpoint), in the layout read_safetensors reads."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    pos = 0
    for name, value in tensors.items():
        blob = np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [pos, pos + len(blob)]}
        blobs.append(blob)
        pos += len(blob)
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
