"""Read a GGUF file: validated metadata, the hyper-parameters of its architecture family, and tensors as raw
blocks.

Everything that can be wrong with an input file is turned into InvalidModelFile / UnsupportedModel here,
so the converter below can assume a well-formed GGUF of a known family (models/convert/families).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from models.convert.families import FAMILIES, Family, ModelConfig, family_for
from models.errors import InvalidModelFile, UnsupportedModel

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32: "F32",
    GGMLQuantizationType.F16: "F16",
    GGMLQuantizationType.Q8_0: "Q8_0",
    GGMLQuantizationType.Q4_0: "Q4_0",
    GGMLQuantizationType.Q4_1: "Q4_1",
}
# TEMPORARY (h-arch, until the exact mapping of every GGUF type lands from h-quant): these types are read
# through gguf.quants.dequantize, so the architecture work (Gemma 3: Q5_0, Q4_K, Q6_K) can be checked in
# fp32. Their 4/8-bit variants are re-quantized (pack_tensor's fallback), not exact.
FALLBACK_TYPES = {
    t: t.name
    for t in (
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.BF16,
    )
}


@dataclass(frozen=True)
class Tensor:
    """A GGUF tensor in its stored form. `rows` x `cols` in the torch-Linear sense (out, in)."""

    name: str
    type_name: str
    rows: int
    cols: int
    data: np.ndarray  # F32/F16: (rows, cols) floats; quantized: (rows, bytes_per_row) uint8

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32."""
        if self.type_name == "F32":
            return np.asarray(self.data, dtype=np.float32).reshape(self.rows, self.cols)
        if self.type_name == "F16":
            return np.asarray(self.data, dtype=np.float16).reshape(self.rows, self.cols).astype(np.float32)
        if self.type_name in FALLBACK_TYPES.values():  # TEMPORARY, see FALLBACK_TYPES
            from gguf.quants import dequantize

            qtype = GGMLQuantizationType[self.type_name]
            return dequantize(np.asarray(self.data), qtype).astype(np.float32).reshape(self.rows, self.cols)
        blocks = self.data.reshape(self.rows, -1, BLOCK_BYTES[self.type_name])
        return dequantize_blocks(self.type_name, blocks).reshape(self.rows, self.cols)


def dequantize_rows(t: Tensor, rows: np.ndarray | slice) -> np.ndarray:
    """Some rows of a tensor in fp32, without dequantizing the rest (a GGUF row is whole blocks)."""
    data = np.asarray(t.data)[rows]
    return replace(t, rows=int(data.shape[0]), data=data).dequantize()


def dequantize_chunked(t: Tensor, chunk_rows: int = 16384) -> np.ndarray:
    """Tensor.dequantize into one preallocated array, a row chunk at a time: the temporaries of a
    vocabulary-sized table (Gemma 3: 262,144 x 640) stay a chunk's size, not the table's."""
    if t.rows <= chunk_rows:  # also every 1-D tensor, whose data has no row axis
        return t.dequantize()
    out = np.empty((t.rows, t.cols), np.float32)
    for start in range(0, t.rows, chunk_rows):
        out[start : start + chunk_rows] = dequantize_rows(t, slice(start, start + chunk_rows))
    return out


BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """blocks: (..., block_bytes) uint8 -> (..., 32) float32, GGML's exact formulas."""
    if type_name == "Q8_0":
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return d * q
    if type_name == "Q4_0":
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        q = unpack_q4_nibbles(blocks[..., 2:]).astype(np.float32)
        return d * (q - 8.0)
    if type_name == "Q4_1":
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        q = unpack_q4_nibbles(blocks[..., 4:]).astype(np.float32)
        return d * q + m
    raise UnsupportedModel(f"tensor type {type_name} is not supported")


def unpack_q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML layout: byte j holds element j (low nibble) and element j+16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


class GGUFModel:
    """An opened, validated GGUF of a supported architecture family."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.reader = open_reader(self.path)
        self.metadata = read_metadata(self.reader)
        self.family: Family = family_for(self.metadata.get("general.architecture"), self.path.name)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()
        self._check_tensors()

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise InvalidModelFile(f"{self.path.name}: missing metadata key {key}")
        return value

    def _int(self, key: str, default: Any = None) -> int:
        value = self._get(key, default)
        if isinstance(value, list) or not isinstance(value, (int, float)):
            # per-layer arrays (OpenELM-style head counts) have no family here
            raise UnsupportedModel(
                f"{self.path.name}: {key} = {value!r} is not supported (one value expected)"
            )
        return int(value)

    def _config(self) -> ModelConfig:
        """The generic `{arch}.*` keys (as llama.cpp's hparams loader reads them); the family's `configure`
        adds what is its own."""
        a = self.family.name
        hidden = self._int(f"{a}.embedding_length")
        n_heads = self._int(f"{a}.attention.head_count")
        head_dim = self._int(f"{a}.attention.key_length", hidden // n_heads)
        value_dim = self._int(f"{a}.attention.value_length", head_dim)
        if value_dim != head_dim:
            raise UnsupportedModel(
                f"{self.path.name}: key length {head_dim} != value length {value_dim} is not supported"
            )
        rope_dim = self._int(f"{a}.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise UnsupportedModel(
                f"{self.path.name}: partial RoPE ({rope_dim} of {head_dim}) is not supported"
            )
        scaling = self.metadata.get(f"{a}.rope.scaling.type")
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = 1.0 / float(self._get(f"{a}.rope.scaling.factor"))
        elif scaling not in (None, "none"):
            raise UnsupportedModel(f"{self.path.name}: RoPE scaling {scaling!r} is not supported (linear is)")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise InvalidModelFile(f"{self.path.name}: missing tensor token_embd.weight")
        cfg = ModelConfig(
            architecture=a,
            n_layers=self._int(f"{a}.block_count"),
            hidden=hidden,
            ffn=self._int(f"{a}.feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=self._int(f"{a}.attention.head_count_kv", n_heads),
            head_dim=head_dim,
            rope_base=float(self.metadata.get(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(self._get(f"{a}.attention.layer_norm_rms_epsilon")),
            context_length=self._int(f"{a}.context_length"),
            vocab=self._int(f"{a}.vocab_size", int(embd.shape[1])),
            tied_embeddings="output.weight" not in self.tensors,
            rope_scale=rope_scale,
        )
        if cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads:
            raise InvalidModelFile(
                f"{self.path.name}: {cfg.n_heads} heads cannot share {cfg.n_kv_heads} KV heads"
            )
        return self.family.configure(cfg, self.metadata, self.tensors.keys())

    def _check_tensors(self) -> None:
        """Every tensor the family needs, with its shape; none it would silently ignore (a bias or norm we
        do not apply would give fluent nonsense)."""
        expected = self.family.tensor_shapes(self.config)
        unused = sorted(set(self.tensors) - set(expected))
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise UnsupportedModel(
                f"{self.path.name}: tensors {', '.join(unused[:3])}{more} are not part of the "
                f"{self.family.name} family as supported here"
            )
        for name, (rows, cols) in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise InvalidModelFile(f"{self.path.name}: missing tensor {name}")
            if t.tensor_type not in SUPPORTED_TYPES and t.tensor_type not in FALLBACK_TYPES:
                raise UnsupportedModel(
                    f"{self.path.name}: tensor {name} has type {t.tensor_type.name}; supported types: "
                    f"{', '.join([*SUPPORTED_TYPES.values(), *FALLBACK_TYPES.values()])}"
                )
            shape = tuple(int(x) for x in t.shape)  # GGUF order: (cols, rows) or (n,)
            got = (shape[1], shape[0]) if len(shape) == 2 else (1, shape[0])
            if got != (rows, cols):
                raise InvalidModelFile(
                    f"{self.path.name}: tensor {name} has shape {got}, expected {(rows, cols)}"
                )

    def tensor(self, name: str) -> Tensor:
        t = self.tensors[name]
        shape = [int(x) for x in t.shape]
        rows, cols = (shape[1], shape[0]) if len(shape) == 2 else (1, shape[0])
        type_name = SUPPORTED_TYPES.get(t.tensor_type) or FALLBACK_TYPES[t.tensor_type]
        return Tensor(name, type_name, rows, cols, np.asarray(t.data))

    def tensor_types(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.reader.tensors:
            name = SUPPORTED_TYPES.get(t.tensor_type, t.tensor_type.name)
            out[name] = out.get(name, 0) + 1
        return out


class FastGGUFReader(GGUFReader):
    """gguf.GGUFReader with the same fields and tensors, parsed about 20x faster.

    The stock reader slices a numpy.memmap once per array element (each slice pays memmap bookkeeping), so
    Gemma 3's 262,144-token vocabulary (tokens, scores, types) took 35-90 s to open on this machine. Here
    scalar reads slice a plain ndarray view of the same map, and arrays are cut from one view per array,
    with the stock layout (one part per element) so `ReaderField.contents()` and its users are unchanged.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n, offs = int(alen[0]), orig_offs + 12
        itype = GGUFValueType(int(raw_itype[0]))
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            plain, u64 = self._plain, np.dtype(np.uint64)
            buf = plain.data
            for _ in range(n):
                (slen,) = struct.unpack_from("<Q", buf, offs)
                parts.append(plain[offs : offs + 8].view(u64))
                parts.append(plain[offs + 8 : offs + 8 + slen])
                offs += 8 + slen
            return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # nested arrays: the stock path
            return super()._get_field_parts(orig_offs, raw_type)
        whole = self._get(offs, nptype, n)
        parts += [whole[i : i + 1] for i in range(n)]
        return 12 + int(whole.nbytes), parts, list(range(2, n + 2)), [GGUFValueType.ARRAY, itype]


def open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise InvalidModelFile(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidModelFile(f"{path.name}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = FastGGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors for damaged files
        raise InvalidModelFile(f"{path.name}: cannot read GGUF ({type(e).__name__}: {e}); truncated?") from e
    # GGUFReader memory-maps lazily: check that every tensor's bytes lie inside the file.
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise InvalidModelFile(f"{path.name}: truncated: tensor {t.name} ends past the end of the file")
    return reader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalars and small arrays as Python values; the big tokenizer arrays are left to the tokenizer."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an odd field we do not need must not stop the load
            continue
    return out


# GGUF value types: struct format of the scalars (8 = string, 9 = array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_kv_section(f: BinaryIO, wanted: set[str]) -> dict[str, Any]:
    """The values of the `wanted` keys, reading only the key-value section (no tensor is mapped)."""

    def unpack(fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("the file ends inside its metadata")
        return struct.unpack("<" + fmt, data)[0]

    def string() -> str:
        n = unpack("Q")
        data = f.read(n)
        if len(data) != n:
            raise ValueError("the file ends inside its metadata")
        return data.decode("utf-8")

    def value(vtype: int) -> Any:
        if vtype == 8:
            return string()
        if vtype == 9:
            itype, n = unpack("I"), unpack("Q")
            if itype == 8:
                return [string() for _ in range(n)]
            if itype not in _GGUF_SCALARS:
                return [value(itype) for _ in range(n)]
            fmt = _GGUF_SCALARS[itype]
            data = f.read(n * struct.calcsize(fmt))
            return np.frombuffer(data, dtype=np.dtype("<" + fmt if fmt != "?" else "?"), count=n).tolist()
        if vtype in _GGUF_SCALARS:
            return unpack(_GGUF_SCALARS[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")

    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    if unpack("I") not in (2, 3):
        raise ValueError("unsupported GGUF version")
    unpack("Q")  # tensor count
    meta: dict[str, Any] = {}
    for _ in range(unpack("Q")):
        key = string()
        v = value(unpack("I"))
        if key in wanted:
            meta[key] = v
    return meta
