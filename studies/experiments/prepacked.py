"""onnxruntime's prepacked weights written once and memory-mapped, against packing them at every load.

Stock onnxruntime (1.20 on) can save the optimized graph of a session with the packed forms of its constant
initializers in the external data file (`optimized_model_filepath` with the session config entries
`session.optimized_model_external_initializers_file_name` and
`session.save_external_prepacked_constant_initializers = 1`); a later session of that file maps the packed
buffers instead of allocating them. onnxruntime 1.32 still packs every weight of such a file at load, to
compare with what it maps (the report's `validation`: one packed byte changed fails the load).

This writes that file once for a variant, then loads the variant both ways and llama.cpp on the same GGUF,
each in its own process, interleaved round by round:

- `today`: the variant as the engine opens it (DecoderSession: packing at load, the copied spans released,
  the mapped tables read in);
- `prepacked`: the optimized file, graph optimizations as usual (ORT_ENABLE_ALL);
- `prepacked-noopt`: the optimized file with graph optimizations off (it is already optimized);
- `no-prepacking` (with `--modes`): today's load with `session.disable_prepacking`: how much of a load the
  packing is, and what decoding unpacked weights costs (a few tokens only: it is two orders slower);
- `parallel-prepacking` (with `--modes`): today's load with `session.prepack.enable_parallel` (the weights
  packed on the session's threads);
- `llama.cpp`: the GGUF.

Per load: seconds to a usable session, RSS and its split (anonymous: heap and arenas; file: mapped pages),
the high-water mark; then a 2,048-token KV (resident, as the engine keeps it), a 32-token prompt and 64
greedy tokens: decode tok/s and RSS after (steady) with the high-water mark (peak serving). The simmer
configurations must give the same tokens and the same first logits.

    python -m studies.experiments.prepacked --model-dir DIR --gguf GGUF [--variant q4-a8] [--rounds 3] \
        [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = 32
DECODE = 64
UNPACKED_DECODE = 4
N_CTX = 2048
OPTIMIZED = "model.onnx"
OPTIMIZED_DATA = "model.data"


def status() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, VmHWM of this process in MB (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def write_optimized(model: Path, out_dir: Path, threads: int) -> dict[str, Any]:
    """Build one session of `model` that saves its optimized graph and packed weights into out_dir."""
    import onnxruntime as ort

    from models.runtime.session import session_options

    so = session_options(threads)
    so.optimized_model_filepath = str(out_dir / OPTIMIZED)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPTIMIZED_DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    t0 = time.perf_counter()
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return {
        "write_s": round(time.perf_counter() - t0, 2),
        "optimized_bytes": sum(p.stat().st_size for p in out_dir.iterdir()),
        "peak_rss_mb": status()["VmHWM"],
    }


def packed_bytes(onnx_path: Path) -> dict[str, int]:
    """Bytes of the packed buffers in an optimized file, per op type."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    per: dict[str, int] = {}
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key.startswith("prepacked_"):
                op = e.value.split("+", 1)[0]
                for blob in e.value.split("|")[1:]:
                    per[op] = per.get(op, 0) + int(blob.split(";")[1])
    return per


def _external_spans(path: Path) -> dict[str, tuple[int, int]]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    spans = {}
    for t in m.graph.initializer:
        d = {e.key: e.value for e in t.external_data}
        if "offset" in d:
            spans[t.name] = (int(d["offset"]), int(d["length"]))
    return spans


def copied_in_optimized(variant: Path, copied: Any, optimized: Path) -> list[tuple[int, int]]:
    """The manifest's copied spans (in weights.data) as spans of the same initializers in the optimized
    file's data, so both paths give back the same pages (release_copied)."""
    by_span = {span: name for name, span in _external_spans(variant).items()}
    names = {by_span[(int(o), int(n))] for o, n in copied if (int(o), int(n)) in by_span}
    return [span for name, span in _external_spans(optimized).items() if name in names]


def _simmer_session(cfg: dict[str, Any]) -> Any:
    import onnxruntime as ort

    import models.runtime.session as session_mod
    from models.runtime.session import DecoderSession, ModelShape, release_copied

    model_dir = Path(cfg["model_dir"])
    manifest = json.loads((model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    entry = manifest["variants"][cfg["variant"]]
    plain = session_mod.session_options

    def changed(threads: int, spinning: bool = False) -> ort.SessionOptions:
        so = plain(threads, spinning)
        if cfg["mode"] == "prepacked-noopt":
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if cfg["mode"] == "no-prepacking":
            so.add_session_config_entry("session.disable_prepacking", "1")
        if cfg["mode"] == "parallel-prepacking":
            so.add_session_config_entry("session.prepack.enable_parallel", "1")
        return so

    session_mod.session_options = changed
    if cfg["mode"] in ("today", "no-prepacking", "parallel-prepacking"):
        return DecoderSession(
            model_dir / entry["file"], shape, cfg["threads"], copied_at_load=entry.get("copied_at_load") or ()
        )
    optimized = Path(cfg["optimized"]) / OPTIMIZED
    sess = DecoderSession(optimized, shape, cfg["threads"])
    # after the read-in, unlike DecoderSession's own order: the same pages are resident in the end
    release_copied(optimized.parent / OPTIMIZED_DATA, cfg["copied"])
    return sess


def simmer_probe(cfg: dict[str, Any]) -> dict[str, Any]:
    from models.runtime.session import KVCache

    t0 = time.perf_counter()
    sess = _simmer_session(cfg)
    load_s = time.perf_counter() - t0
    loaded = status()
    # Unpacked weights decode two orders slower: a few tokens measure it.
    decode_n = UNPACKED_DECODE if cfg["mode"] == "no-prepacking" else DECODE
    kv = KVCache(sess.shape, N_CTX, prefault=True)
    ids = [300 + (j * 7919) % 20000 for j in range(PROMPT)]
    logits = sess.run(np.array(ids), kv, 0)
    first = hashlib.sha256(logits.tobytes()).hexdigest()[:16]
    out = [int(logits.argmax())]
    t1 = time.perf_counter()
    for i in range(decode_n):
        out.append(int(sess.run(np.array([out[-1]]), kv, PROMPT + i).argmax()))
    decode = decode_n / (time.perf_counter() - t1)
    return _result(cfg, load_s, loaded, decode, out, first)


def llama_probe(cfg: dict[str, Any]) -> dict[str, Any]:
    from bench.llama_peer import open_llama

    t0 = time.perf_counter()
    llm = open_llama(
        cfg["gguf"],
        extra_bufts=cfg.get("extra_bufts"),
        n_ctx=N_CTX,
        n_threads=cfg["threads"],
        n_threads_batch=cfg["threads"],
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    loaded = status()
    ids = [300 + (j * 7919) % 20000 for j in range(PROMPT)]
    llm.eval(ids)

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    out = [argmax()]
    t1 = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([out[-1]])
        out.append(argmax())
    decode = DECODE / (time.perf_counter() - t1)
    return _result(cfg, load_s, loaded, decode, out, None)


def _result(
    cfg: dict[str, Any],
    load_s: float,
    loaded: dict[str, float],
    decode: float,
    tokens: list[int],
    first_logits: str | None,
) -> dict[str, Any]:
    served = status()
    return {
        "config": cfg,
        "load_s": round(load_s, 3),
        "rss_loaded_mb": loaded["VmRSS"],
        "anon_loaded_mb": loaded["RssAnon"],
        "file_loaded_mb": loaded["RssFile"],
        "peak_load_mb": loaded["VmHWM"],
        "decode_tok_s": round(decode, 2),
        "rss_steady_mb": served["VmRSS"],
        "anon_steady_mb": served["RssAnon"],
        "file_steady_mb": served["RssFile"],
        "peak_serving_mb": served["VmHWM"],
        "tokens": tokens,
        "first_logits_sha256": first_logits,
    }


NUMERIC = (
    "load_s",
    "rss_loaded_mb",
    "anon_loaded_mb",
    "file_loaded_mb",
    "peak_load_mb",
    "decode_tok_s",
    "rss_steady_mb",
    "anon_steady_mb",
    "file_steady_mb",
    "peak_serving_mb",
)


MODES = ("today", "prepacked", "prepacked-noopt")


def run(
    model_dir: Path,
    gguf: Path | None,
    variant: str,
    rounds: int,
    threads: int,
    work: Path,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    from bench.engine_bench import machine, run_probe

    manifest = json.loads((model_dir / "manifest.json").read_text())
    entry = manifest["variants"][variant]
    write = any(m.startswith("prepacked") for m in modes)
    written: dict[str, Any] = {}
    copied: list[tuple[int, int]] = []
    if write:
        written = run_probe(
            {"write": str(model_dir / entry["file"]), "out": str(work), "threads": threads},
            3600,
            "studies.experiments.prepacked",
        )
        if "error" in written:
            return {"error": written["error"]}
        written["packed_bytes"] = packed_bytes(work / OPTIMIZED)
        copied = copied_in_optimized(
            model_dir / entry["file"], entry.get("copied_at_load") or (), work / OPTIMIZED
        )
    base = {"model_dir": str(model_dir), "variant": variant, "threads": threads, "optimized": str(work)}
    configs: list[dict[str, Any]] = [
        {"engine": "simmer", "mode": m, **base, "copied": copied if m.startswith("prepacked") else []}
        for m in modes
    ]
    if gguf is not None:
        from bench.llama_peer import extra_bufts_work

        extra = extra_bufts_work(gguf)
        configs.append(
            {
                "engine": "llama.cpp",
                "mode": "gguf",
                "gguf": str(gguf),
                "threads": threads,
                "extra_bufts": extra,
            }
        )
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for cfg in configs[r % len(configs) :] + configs[: r % len(configs)]:
            name = f"{cfg['engine']}:{cfg['mode']}"
            print(f"[prepacked] round {r + 1}/{rounds} {name}", file=sys.stderr, flush=True)
            runs.setdefault(name, []).append(run_probe(cfg, 1800, "studies.experiments.prepacked"))
    summary: dict[str, Any] = {}
    for name, got in runs.items():
        ok = [g for g in got if "error" not in g]
        if not ok:
            summary[name] = {"error": got[0]["error"]}
            continue
        summary[name] = {k: statistics.median(g[k] for g in ok) for k in NUMERIC if k in ok[0]}
        summary[name]["load_s_all"] = [g["load_s"] for g in ok]
        if "tokens" in ok[0]:
            summary[name]["tokens"] = ok[0]["tokens"]
            summary[name]["first_logits_sha256"] = sorted({str(g["first_logits_sha256"]) for g in ok})
    checked = (
        run_probe({"validate": str(work / OPTIMIZED)}, 1800, "studies.experiments.prepacked") if write else {}
    )
    # Unpacked weights take another kernel (fp32 activations, not int8), so their tokens may differ: reported
    # beside the others, not part of the check that packing changes nothing.
    packed = {n: s for n, s in summary.items() if n.startswith("simmer:") and n != "simmer:no-prepacking"}
    simmer = [s for s in packed.values() if "tokens" in s]
    return {
        "experiment": "prepacked",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "model_dir": str(model_dir),
        "variant": variant,
        "threads": threads,
        "rounds": rounds,
        "written_once": written,
        "validation": checked,
        "same_tokens_and_logits": len({json.dumps([s["tokens"], s["first_logits_sha256"]]) for s in simmer})
        == 1,
        "results": summary,
    }


def main() -> None:
    p = argparse.ArgumentParser(description="prepacked weights written once, against packing at load")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--gguf", default=None, help="llama.cpp's peer run on this GGUF")
    p.add_argument("--variant", default="q4-a8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="of today, prepacked, prepacked-noopt, no-prepacking, parallel-prepacking",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepacked-") as tmp:
        report = run(
            Path(args.model_dir),
            Path(args.gguf) if args.gguf else None,
            args.variant,
            args.rounds,
            args.threads,
            Path(tmp),
            tuple(args.modes.split(",")),
        )
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


def validation(optimized: Path) -> dict[str, Any]:
    """Whether onnxruntime reads the written packed buffers blindly: one byte of the first MatMulNBits
    packed buffer changed (and restored), then a session of the file."""
    import onnx
    import onnxruntime as ort

    from models.runtime.session import session_options

    m = onnx.load(str(optimized), load_external_data=False)
    blob = next(
        e.value.split("|")[1]
        for t in m.graph.initializer
        for e in t.external_data
        if e.key.startswith("prepacked_") and e.value.startswith("MatMulNBits+")
    )
    offset = int(blob.split(";")[0]) + int(blob.split(";")[1]) // 2
    with (optimized.parent / OPTIMIZED_DATA).open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        ort.InferenceSession(str(optimized), session_options(1), providers=["CPUExecutionProvider"])
        outcome = "loaded"
    except Exception as e:  # the point: what onnxruntime says
        outcome = str(e).splitlines()[0][-200:]
    finally:
        with (optimized.parent / OPTIMIZED_DATA).open("r+b") as f:
            f.seek(offset)
            f.write(byte)
    return {"one_packed_byte_changed": outcome}


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    if "validate" in cfg:
        return validation(Path(cfg["validate"]))
    if "write" in cfg:
        return write_optimized(Path(cfg["write"]), Path(cfg["out"]), cfg["threads"])
    return simmer_probe(cfg) if cfg["engine"] == "simmer" else llama_probe(cfg)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(probe(json.loads(sys.argv[1]))))
    else:
        main()
