"""What a sentence-transformers BERT folder says about its encoder: config.json (the BERT), modules.json
(Transformer -> Pooling -> Normalize), 1_Pooling/config.json (which pooling) and sentence_bert_config.json
(the sequence length it was trained at, which is the context simmer serves).

Only what the graph builds is accepted: BERT with absolute positions, exact GELU, mean pooling; anything
else is an UnsupportedModel naming the field, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from models.errors import InvalidModelFile, UnsupportedModel

CONFIG = "config.json"
MODULES = "modules.json"
SENTENCE_CONFIG = "sentence_bert_config.json"
WEIGHTS = "model.safetensors"
# A converted encoder's folder, as the converter writes it and the runtime reads it (named here, where
# neither needs onnx: importing it costs the server's start most of a second)
ENCODER_CONFIG = "encoder.json"
TOKENIZER = "tokenizer.json"
GRAPH = "encoder.onnx"
# The variants: `f32` the exact graph; `int8` its linear layers on MatMulNBits (8-bit weights per block of
# 32, int8 activations), embeddings, LayerNorm and attention left in fp32 (models/convert/encoder_int8.py)
F32 = "f32"
INT8 = "int8"
GRAPHS = {F32: GRAPH, INT8: "encoder-int8.onnx"}
OUTPUT = "sentence_embedding"
_NORMALIZE = "sentence_transformers.models.Normalize"
_POOLING = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class EncoderConfig:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int
    type_vocab: int
    eps: float
    context: int  # the longest input served, in tokens (special tokens included)
    normalize: bool
    pad_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EncoderConfig:
        try:
            return cls(**data)
        except TypeError as err:
            raise InvalidModelFile(f"encoder config does not match this simmer ({err})") from err


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidModelFile(f"cannot read {path.name}: {err}") from err


def _require(cfg: dict[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    value = cfg.get(key, allowed[0])
    if value not in allowed:
        raise UnsupportedModel(
            f"{CONFIG}: {key} {value!r} is not supported (only {', '.join(map(str, allowed))})"
        )


def read_encoder_config(folder: Path) -> EncoderConfig:
    folder = Path(folder)
    cfg = _read(folder / CONFIG)
    _require(cfg, "model_type", ("bert",))
    _require(cfg, "hidden_act", ("gelu",))
    _require(cfg, "position_embedding_type", ("absolute",))
    modules = _read(folder / MODULES) if (folder / MODULES).is_file() else []
    kinds = [m.get("type") for m in modules]
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type") == _POOLING), "1_Pooling")
    pooling = _read(folder / pooling_dir / "config.json")
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise UnsupportedModel(f"pooling {modes} is not supported (only mean pooling)")
    sentence = _read(folder / SENTENCE_CONFIG) if (folder / SENTENCE_CONFIG).is_file() else {}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_positions = int(cfg["max_position_embeddings"])
        config = EncoderConfig(
            layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            max_positions=max_positions,
            type_vocab=int(cfg.get("type_vocab_size", 2)),
            eps=float(cfg.get("layer_norm_eps", 1e-12)),
            context=min(int(sentence.get("max_seq_length", max_positions)), max_positions),
            normalize=_NORMALIZE in kinds,
            pad_id=int(cfg.get("pad_token_id", 0)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidModelFile(f"{CONFIG} lacks or garbles {err}") from err
    if hidden % heads:
        raise InvalidModelFile(f"{CONFIG}: hidden_size {hidden} is not a multiple of {heads} heads")
    return config
