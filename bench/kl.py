"""How far each engine's next-token distribution is from the fp32 reference forward of the same GGUF: the
method of `llama-perplexity --kl-divergence`. Over a fixed text (prose, code, facts), teacher-forced one
token at a time, every position's softmax is compared with the reference's: the mean of KL(reference ||
engine) over the positions, its 99th percentile, and how often both put the same token first.

Each step runs in its own process (the reference of a 1.5B model streams its layers but still takes a few
hundred MB; an engine's session takes its weights):
    python -m bench.kl '{"engine": "reference", "gguf": ..., "out": "ref.npy"}'
    python -m bench.kl '{"engine": "simmer", "model_dir": ..., "variant": "q4-a8", "threads": 2, ...}'
    python -m bench.kl '{"engine": "llama.cpp", "gguf": ..., "threads": 2, "reference": "ref.npy"}'
The engines are fed the reference's token ids (llama-cpp-python with logits_all, one token per call).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

KL_TEXT = (
    "The Moon is Earth's only natural satellite. It orbits at an average distance of 384,400 km and "
    "takes about 27.3 days to go around once. In 1969, Apollo 11 landed there with three astronauts.\n\n"
    "def binary_search(items, target):\n"
    "    lo, hi = 0, len(items) - 1\n"
    "    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n"
    "        if items[mid] == target:\n"
    "            return mid\n"
    "        if items[mid] < target:\n"
    "            lo = mid + 1\n"
    "        else:\n"
    "            hi = mid - 1\n"
    "    return -1\n\n"
    "Water boils at 100 degrees Celsius at sea level, and Paris is the capital of France. "
    "A prime number has exactly two divisors: 2, 3, 5, 7 and 11 are the first five."
)
MAX_TOKENS = 256


def text_ids(gguf: Path) -> list[int]:
    """The text's token ids by the model's own tokenizer (its BOS first when the model adds one)."""
    from models.convert.model import GGUFModel
    from models.convert.tokenizer_gguf import metadata_from_reader, tokenizer_from_metadata

    model = GGUFModel(gguf)
    tok = tokenizer_from_metadata(metadata_from_reader(model.reader))
    return tok.encode(KL_TEXT, add_special_tokens=True)[:MAX_TOKENS]


def reference(cfg: dict[str, Any]) -> dict[str, Any]:
    from models.convert.model import GGUFModel
    from models.convert.reference import ReferenceForward

    ids = text_ids(Path(cfg["gguf"]))
    logits = ReferenceForward(GGUFModel(Path(cfg["gguf"]))).logits(ids)
    np.save(cfg["out"], logits)
    Path(cfg["out"]).with_suffix(".json").write_text(json.dumps(ids))
    return {"positions": len(ids)}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> dict[str, Any]:
    """KL(ref || got) per position, from logits [positions, vocab]."""
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {
        "kl_mean": round(float(kl.mean()), 6),
        "kl_p99": round(float(np.percentile(kl, 99)), 6),
        "top1_agreement": round(float((ref.argmax(-1) == got.argmax(-1)).mean()), 4),
        "positions": len(kl),
    }


def simmer_logits(cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    from models.runtime.session import DecoderSession, KVCache, ModelShape

    model_dir = Path(cfg["model_dir"])
    manifest = json.loads((model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    sess = DecoderSession(model_dir / manifest["variants"][cfg["variant"]]["file"], shape, cfg["threads"])
    kv = KVCache(sess.shape, len(ids))  # the session's: its KV type is the graph's
    return np.stack([sess.run(np.array([t]), kv, pos).copy() for pos, t in enumerate(ids)])


def llama_logits(cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    from bench.llama_peer import open_llama

    llm = open_llama(
        cfg["gguf"],
        extra_bufts=cfg.get("extra_bufts"),
        n_ctx=len(ids) + 8,
        n_threads=cfg["threads"],
        logits_all=True,
        verbose=False,
    )
    out = []
    for t in ids:
        llm.eval([t])
        out.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
    return np.stack(out)


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["engine"] == "reference":
        return reference(cfg)
    ref = np.load(cfg["reference"], mmap_mode="r")
    ids = json.loads(Path(cfg["reference"]).with_suffix(".json").read_text())
    got = simmer_logits(cfg, ids) if cfg["engine"] == "simmer" else llama_logits(cfg, ids)
    return {"config": cfg, **compare(np.asarray(ref), got)}


def bench_kl(
    model_dir: Path,
    gguf: Path,
    variants: list[str],
    threads: int,
    peer: bool,
    extra_bufts: bool | None = None,
) -> dict[str, Any]:
    """Every variant and (with `peer`) llama.cpp against the fp32 reference of the GGUF."""
    import tempfile

    from bench.engine_bench import run_probe

    with tempfile.TemporaryDirectory() as tmp:
        ref = str(Path(tmp) / "reference.npy")
        made = run_probe({"engine": "reference", "gguf": str(gguf), "out": ref}, 3600, "bench.kl")
        if "error" in made:
            return {"error": made["error"]}
        configs = [
            {
                "engine": "simmer",
                "model_dir": str(model_dir),
                "variant": v,
                "threads": threads,
                "reference": ref,
            }
            for v in variants
        ]
        if peer:
            peer_cfg = {"engine": "llama.cpp", "gguf": str(gguf), "threads": threads, "reference": ref}
            configs.append({**peer_cfg, "extra_bufts": extra_bufts})
        rows = {}
        for cfg in configs:
            name = f"{cfg['engine']}:{cfg.get('variant', 'gguf')}"
            print(f"[bench engine] KL {name}", file=sys.stderr, flush=True)
            got = run_probe(cfg, 1800, "bench.kl")
            rows[name] = {k: v for k, v in got.items() if k != "config"}
    return {
        "how": "KL(fp32 reference || engine) of the next-token distribution, teacher-forced one token at a "
        f"time over bench/kl.py's text ({made['positions']} tokens), as llama-perplexity --kl-divergence",
        "results": rows,
    }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
