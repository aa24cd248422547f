"""A sentence-transformers BERT folder as a GGUF of llama.cpp's `bert` architecture, so llama.cpp can be
the peer of simmer's encoder on the same weights (no GGUF of all-MiniLM-L6-v2 is published where simmer
fetches its models, and convert_hf_to_gguf.py needs torch and transformers).

What llama.cpp's convert_hf_to_gguf.py writes for `BertModel` (conversion/bert.py, llama-cpp-python
0.3.36's vendor/llama.cpp), from the folder's own files and with numpy alone:
- hyperparameters from config.json (the context is `max_positions`: llama.cpp sizes the position
  embeddings by it), non-causal attention, the pooling of 1_Pooling/config.json;
- the WordPiece vocabulary in llama.cpp's "phantom space" spelling: a word-initial piece gets a leading
  U+2581, a `##` continuation loses its `##`, a control (special) token stays as it is;
- the tensors renamed by gguf-py's name map for `bert`; the pooler and masked-LM heads left out;
- `--outtype`'s rule for the matrices (f32, f16, or q8_0 with an f16 fallback for a row that is not
  whole blocks), vectors, norms and the rows added to activations kept in f32.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from models.convert.encoder_config import WEIGHTS, EncoderConfig, read_encoder_config
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidModelFile

TOKENIZER = "tokenizer.json"
DTYPES = ("f32", "f16", "q8_0")
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# convert_hf_to_gguf.py names a pre-tokenizer by hashing the ids of a fixed text: bert-base-uncased's
# vocabulary (all-MiniLM-L6-v2's) hashes to the name it gives bge-small-en-v1.5. llama.cpp's WordPiece
# tokenizer reads no pre-tokenizer, so the name is informative only.
_PRE = "bert-bge"
# Checkpoint entries that are no part of the encoder llama.cpp runs: a buffer, the next-sentence pooler,
# the masked-LM heads (convert_hf_to_gguf.py drops them too).
_SKIPPED = ("embeddings.position_ids", "pooler.", "cls.")
# Kept in float32 in an f16 file, as convert_hf_to_gguf.py keeps them: llama.cpp adds these rows to the
# activations directly.
_F32_ALWAYS = {gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES}


def phantom(token: str, token_type: int = gguf.TokenType.NORMAL) -> str:
    """A vocabulary entry as llama.cpp's WordPiece tokenizer looks it up (a control token as it is)."""
    if token_type == gguf.TokenType.CONTROL:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def vocabulary(tokenizer: dict, size: int) -> tuple[list[str], list[int]]:
    """The tokens by id and their llama.cpp types, `size` long (ids no entry names are unused padding)."""
    model = tokenizer.get("model", {})
    if model.get("type") != "WordPiece":
        raise InvalidModelFile(f"{TOKENIZER}: a WordPiece tokenizer expected, not {model.get('type')!r}")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tokenizer.get("added_tokens", [])}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(size):
        if i in added:
            special = added[i].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(phantom(added[i]["content"], types[-1]))
        elif i in by_id:
            tokens.append(phantom(by_id[i]))
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def tensors(weights: dict[str, np.ndarray], layers: int) -> list[tuple[str, gguf.MODEL_TENSOR, np.ndarray]]:
    """(GGUF name, its kind, data) of every encoder tensor, in the checkpoint's names' order. A name the
    map does not know is refused: a weight llama.cpp would not load means a model it would run wrong."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    out = []
    for name, data in weights.items():
        name = name.removeprefix("bert.")
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        if name.startswith(_SKIPPED):
            continue
        found = names.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise InvalidModelFile(f"{WEIGHTS}: tensor {name} has no place in llama.cpp's bert")
        kind, new_name = found
        out.append((new_name, kind, data))
    return out


def _stored(
    kind: gguf.MODEL_TENSOR, name: str, data: np.ndarray, dtype: str
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(data, its block type or None for a float array). convert_hf_to_gguf.py's rule: 1-D tensors and
    norms stay float32 (llama.cpp's kernels for them are float32-only), as do the rows added to
    activations; other matrices take the file's type, Q8_0 falling back to F16 where rows are not whole
    blocks."""
    keep = data.ndim <= 1 or name.endswith("_norm.weight") or kind in _F32_ALWAYS
    if keep or dtype == "f32":
        return data.astype(np.float32), None
    if dtype == "q8_0":
        q8 = gguf.GGMLQuantizationType.Q8_0
        try:
            return gguf.quants.quantize(data.astype(np.float32), q8), q8
        except gguf.QuantError:
            pass
    return data.astype(np.float16), None


def write_bert_gguf(source: Path, out: Path, dtype: str = "f32") -> EncoderConfig:
    """Write `source` (a sentence-transformers BERT folder) to `out` as a GGUF; the encoder's config."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    source, out = Path(source), Path(out)
    cfg = read_encoder_config(source)  # refuses what simmer's encoder does not run: the same model or none
    tokenizer = json.loads((source / TOKENIZER).read_text(encoding="utf-8"))
    tokens, types = vocabulary(tokenizer, cfg.vocab)

    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_name(source.name)
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_block_count(cfg.layers)
    writer.add_context_length(cfg.max_positions)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.intermediate)
    writer.add_head_count(cfg.heads)
    writer.add_layer_norm_eps(cfg.eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)  # read_encoder_config accepts mean pooling alone
    writer.add_token_type_count(cfg.type_vocab)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre(_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # [CLS], [SEP], [UNK], [PAD], [MASK] and the add-special flags, read as the converter reads them
    gguf.SpecialVocab(source, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)

    for name, kind, data in tensors(read_safetensors(source / WEIGHTS), cfg.layers):
        stored, raw_dtype = _stored(kind, name, data, dtype)
        writer.add_tensor(name, stored, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return cfg
