"""Read a GGUF file: validated metadata, the Llama hyper-parameters, and tensors as raw blocks.

Everything that can be wrong with an input file is turned into InvalidModelFile / UnsupportedModel here,
so the converter below can assume a well-formed Llama GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from models.errors import InvalidModelFile, UnsupportedModel, UnsupportedQuantization
from models.gguf.blocks import decode

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
# every type the converter maps exactly (models/gguf/blocks.py has the block formats)
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = {
    GGMLQuantizationType[name]: name
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_QUANTS)
}


def unsupported_quantization(file: str, tensor: str, qtype: GGMLQuantizationType) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"{file}: tensor {tensor} is quantized as {qtype.name}, which simmer cannot convert exactly "
        f"(supported: {', '.join(SUPPORTED_TYPES.values())}); pick a GGUF of another quantization, "
        "such as Q4_K_M or Q8_0"
    )


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float
    context_length: int
    vocab: int
    tied_embeddings: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Tensor:
    """A GGUF tensor in its stored form. `rows` x `cols` in the torch-Linear sense (out, in)."""

    name: str
    type_name: str
    rows: int
    cols: int
    data: np.ndarray  # F32/F16: (rows, cols) floats; BF16 and block formats: (rows, bytes_per_row) uint8

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32, bit-for-bit GGML's dequantization."""
        if self.type_name == "F32":
            return np.asarray(self.data, dtype=np.float32).reshape(self.rows, self.cols)
        if self.type_name == "F16":
            return np.asarray(self.data, dtype=np.float16).reshape(self.rows, self.cols).astype(np.float32)
        if self.type_name == "BF16":
            bits = np.ascontiguousarray(self.data).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.rows, self.cols)
        return decode(self.type_name, self.data, self.rows).dequantize()


class GGUFModel:
    """An opened, validated Llama GGUF."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.reader = open_reader(self.path)
        self.metadata = read_metadata(self.reader)
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{self.path.name}: architecture {arch!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()
        self._check_tensors()

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise InvalidModelFile(f"{self.path.name}: missing metadata key {key}")
        return value

    def _config(self) -> LlamaConfig:
        a = "llama"
        hidden = int(self._get(f"{a}.embedding_length"))
        n_heads = int(self._get(f"{a}.attention.head_count"))
        head_dim = hidden // n_heads
        rope_dim = int(self.metadata.get(f"{a}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModel(
                f"{self.path.name}: partial RoPE ({rope_dim} of {head_dim}) is not supported"
            )
        if self.metadata.get(f"{a}.rope.scaling.type") not in (None, "none"):
            raise UnsupportedModel(f"{self.path.name}: RoPE scaling is not supported")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise InvalidModelFile(f"{self.path.name}: missing tensor token_embd.weight")
        vocab = int(self.metadata.get(f"{a}.vocab_size", int(embd.shape[1])))
        return LlamaConfig(
            n_layers=int(self._get(f"{a}.block_count")),
            hidden=hidden,
            ffn=int(self._get(f"{a}.feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(self.metadata.get(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_base=float(self.metadata.get(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(self._get(f"{a}.attention.layer_norm_rms_epsilon")),
            context_length=int(self._get(f"{a}.context_length")),
            vocab=vocab,
            tied_embeddings="output.weight" not in self.tensors,
        )

    def _check_tensors(self) -> None:
        c = self.config
        expected = {
            "token_embd.weight": (c.vocab, c.hidden),
            "output_norm.weight": (1, c.hidden),
        }
        if not c.tied_embeddings:
            expected["output.weight"] = (c.vocab, c.hidden)
        kv = c.n_kv_heads * c.head_dim
        for i in range(c.n_layers):
            p = f"blk.{i}."
            expected |= {
                p + "attn_norm.weight": (1, c.hidden),
                p + "ffn_norm.weight": (1, c.hidden),
                p + "attn_q.weight": (c.n_heads * c.head_dim, c.hidden),
                p + "attn_k.weight": (kv, c.hidden),
                p + "attn_v.weight": (kv, c.hidden),
                p + "attn_output.weight": (c.hidden, c.n_heads * c.head_dim),
                p + "ffn_gate.weight": (c.ffn, c.hidden),
                p + "ffn_up.weight": (c.ffn, c.hidden),
                p + "ffn_down.weight": (c.hidden, c.ffn),
            }
        for name, (rows, cols) in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise InvalidModelFile(f"{self.path.name}: missing tensor {name}")
            if t.tensor_type not in SUPPORTED_TYPES:
                raise unsupported_quantization(self.path.name, name, t.tensor_type)
            shape = tuple(int(x) for x in t.shape)  # GGUF order: (cols, rows) or (n,)
            got = (shape[1], shape[0]) if len(shape) == 2 else (1, shape[0])
            if got != (rows, cols):
                raise InvalidModelFile(
                    f"{self.path.name}: tensor {name} has shape {got}, expected {(rows, cols)}"
                )

    def tensor(self, name: str) -> Tensor:
        t = self.tensors[name]
        if t.tensor_type not in SUPPORTED_TYPES:
            raise unsupported_quantization(self.path.name, name, t.tensor_type)
        shape = [int(x) for x in t.shape]
        rows, cols = (shape[1], shape[0]) if len(shape) == 2 else (1, shape[0])
        return Tensor(name, SUPPORTED_TYPES[t.tensor_type], rows, cols, np.asarray(t.data))

    def tensor_types(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.reader.tensors:
            name = SUPPORTED_TYPES.get(t.tensor_type, t.tensor_type.name)
            out[name] = out.get(name, 0) + 1
        return out


def open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise InvalidModelFile(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidModelFile(f"{path.name}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
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
