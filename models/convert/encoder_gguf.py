"""A GGUF of llama.cpp's `bert` architecture read as what a sentence-transformers folder gives the encoder
converter: its EncoderConfig, its weights under the checkpoint's names (families/bert.py maps them) and its
tokenizer.json (convert/wordpiece_gguf.py).

What the GGUF does not say is taken as llama.cpp serves the file: the context is `bert.context_length` (the
position table's length: a folder's sentence_bert_config.json, which may say less, is not in it), and the
vector is L2-normalised (llama.cpp's embeddings are, by default). Matrices may be F32, F16, BF16 or Q8_0,
each widened to fp32 exactly as GGML reads it; the graph is fp32 (the encoder's one variant), so a coarser
quantization would only be a worse copy of the same model and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.convert.encoder_config import GRAPH, TOKENIZER, EncoderConfig
from models.convert.families.bert import ENCODER_FAMILIES, EncoderFamily
from models.convert.wordpiece_gguf import wordpiece_tokenizer
from models.errors import InvalidModelFile, UnsupportedModel, UnsupportedQuantization
from models.gguf.reader import GGUFFile, read_kv_section

ENCODER_TYPES = ("F32", "F16", "BF16", "Q8_0")
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
# Bytes of tokenizer.json per vocabulary entry, at most (its vocab map: the piece, its id, the JSON around)
_TOKENIZER_BYTES_PER_TOKEN = 48
_SMALL_FILES = 64 << 10  # encoder.onnx without its weights, encoder.json, the tokenizer's fixed parts
# RSS per fp32 weight byte while the graph is built and saved: the weights dequantized, their copy in the
# ONNX model, the transposed copies of the matrices, the mapped file (measured on all-MiniLM-L6-v2: 4.1)
_BUILD_COPIES = 5


@dataclass
class EncoderGGUF:
    config: EncoderConfig
    weights: dict[str, np.ndarray]  # checkpoint names, fp32
    tokenizer: dict[str, Any]  # tokenizer.json


def gguf_architecture(path: Path) -> str | None:
    """The file's `general.architecture` from its key-value section alone (no tensor mapped), or None
    when the file is no readable GGUF (the converter proper then says what is wrong with it)."""
    try:
        with open(path, "rb") as f:
            value = read_kv_section(f, {"general.architecture"}).get("general.architecture")
    except (OSError, ValueError, MemoryError):  # MemoryError: a garbled string length
        return None
    return value if isinstance(value, str) else None


def is_encoder_gguf(path: Path) -> bool:
    return gguf_architecture(path) in ENCODER_FAMILIES


def encoder_plan(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes per file the conversion writes, bytes its one step adds to RSS), from the GGUF's header."""
    f = GGUFFile(Path(path))
    params = sum(int(t.n_elements) for t in f.reader.tensors)
    field = f.reader.fields.get(_VOCABULARY[0])
    tokens = len(field.data) if field is not None else 0
    disk = {
        f"{GRAPH}.data": 4 * params,
        TOKENIZER: _TOKENIZER_BYTES_PER_TOKEN * tokens + _SMALL_FILES,
        "small files": _SMALL_FILES,
    }
    return disk, {"building the fp32 encoder graph": _BUILD_COPIES * 4 * params}


class _Meta:
    """Typed reads of the file's `{arch}.*` keys, with errors that name the file and the key."""

    def __init__(self, meta: dict[str, Any], arch: str, source: str) -> None:
        self.meta, self.arch, self.source = meta, arch, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise InvalidModelFile(f"{self.source}: missing metadata key {self.arch}.{key}")
        return value

    def int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, (bool, list)) or not isinstance(value, (int, float)):
            raise UnsupportedModel(f"{self.source}: {self.arch}.{key} = {value!r} is not supported")
        return int(value)


def _config(f: GGUFFile, family: EncoderFamily, source: str) -> EncoderConfig:
    k = _Meta(f.metadata, family.architecture, source)
    if k.get("attention.causal", False):
        raise UnsupportedModel(f"{source}: causal attention: not a sentence encoder")
    pooling = k.int("pooling_type", 0)
    if pooling not in family.pooling:
        raise UnsupportedModel(
            f"{source}: {family.architecture}.pooling_type {pooling} is not supported "
            f"(only {', '.join(f'{c} ({n})' for c, n in family.pooling.items())})"
        )

    def rows(name: str) -> int:
        shape = f.shape(name)
        if shape is None:
            raise InvalidModelFile(f"{source}: missing tensor {name}")
        return shape[0]

    hidden, heads = k.int("embedding_length"), k.int("attention.head_count")
    if heads <= 0 or hidden % heads:
        raise InvalidModelFile(f"{source}: embedding_length {hidden} is not a multiple of {heads} heads")
    max_positions = rows("position_embd.weight")
    return EncoderConfig(
        layers=k.int("block_count"),
        hidden=hidden,
        heads=heads,
        intermediate=k.int("feed_forward_length"),
        vocab=rows("token_embd.weight"),
        max_positions=max_positions,
        type_vocab=rows("token_types.weight"),
        # stored as float32: its shortest decimal is what config.json said (1e-12, not 9.99999996e-13)
        eps=float(str(np.float32(k.get("attention.layer_norm_epsilon")))),
        context=min(k.int("context_length", max_positions), max_positions),
        normalize=True,
        pad_id=int(f.metadata.get("tokenizer.ggml.padding_token_id", 0)),
    )


def expected_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the graph reads, with its shape (torch's: a Linear is (out, in))."""
    h, f = cfg.hidden, cfg.intermediate
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg.vocab, h),
        "embeddings.position_embeddings.weight": (cfg.max_positions, h),
        "embeddings.token_type_embeddings.weight": (cfg.type_vocab, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}"
        linears = {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (f, h),
            "output.dense": (h, f),
        }
        for name, (rows, cols) in linears.items():
            shapes[f"{p}.{name}.weight"] = (rows, cols)
            shapes[f"{p}.{name}.bias"] = (rows,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}.{norm}.weight"] = (h,)
            shapes[f"{p}.{norm}.bias"] = (h,)
    return shapes


def _weights(f: GGUFFile, family: EncoderFamily, cfg: EncoderConfig, source: str) -> dict[str, np.ndarray]:
    names = f.names()
    unknown = [n for n in names if family.checkpoint_name(n) is None]
    if unknown:  # a tensor the graph would not apply (a classifier head, fused QKV): a different model
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnsupportedModel(
            f"{source}: tensors {', '.join(unknown[:3])}{more} are not part of the {family.architecture} "
            "encoder as supported here"
        )
    missing = sorted(set(family.gguf_names(cfg.layers)) - set(names))
    if missing:
        raise InvalidModelFile(f"{source}: missing tensor {missing[0]}")
    shapes = expected_shapes(cfg)
    weights: dict[str, np.ndarray] = {}
    for name in names:
        type_name = f.type_name(name)  # UnsupportedQuantization for a type the reader has no mapping for
        if type_name not in ENCODER_TYPES:
            raise UnsupportedQuantization(
                f"{source}: tensor {name} is {type_name}; a sentence encoder's GGUF is converted from "
                f"{', '.join(ENCODER_TYPES)} only (its graph is fp32: pick the F16, F32 or Q8_0 file)"
            )
        key = family.checkpoint_name(name) or name
        want = shapes.get(key)
        data = f.tensor(name).dequantize()
        if want is None or data.size != int(np.prod(want)) or (len(want) == 2 and data.shape != want):
            raise InvalidModelFile(f"{source}: tensor {name} has shape {data.shape}, expected {want}")
        weights[key] = data.reshape(want)
    return weights


def read_encoder_gguf(path: Path) -> EncoderGGUF:
    path = Path(path)
    f = GGUFFile(path)
    source = path.name
    arch = f.metadata.get("general.architecture")
    family = ENCODER_FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise UnsupportedModel(f"{source}: architecture {arch!r} is no sentence encoder simmer converts")
    cfg = _config(f, family, source)
    fields = {key: f.reader.fields.get(key) for key in _VOCABULARY}
    if any(field is None for field in fields.values()):
        raise InvalidModelFile(f"{source}: no vocabulary ({' and '.join(_VOCABULARY)})")
    tokens, types = (list(field.contents()) for field in fields.values() if field is not None)
    if len(tokens) != cfg.vocab:
        raise InvalidModelFile(f"{source}: {len(tokens)} tokens for an embedding table of {cfg.vocab} rows")
    tokenizer = wordpiece_tokenizer(tokens, [int(t) for t in types], f.metadata)
    return EncoderGGUF(cfg, _weights(f, family, cfg, source), tokenizer)
