"""`simmer bench engine`: every variant at 2 threads and 1 against llama.cpp on the same GGUF, interleaved.

Each configuration runs in its own process (bench/engine_probe.py) so load time and RSS are its own; the
configurations are interleaved round by round (this machine's speed drifts 15-20 % over minutes) and the
medians are reported with simmer/llama.cpp ratios.

Energy per token: every configuration (variant x threads x spinning) reports the process CPU seconds per
generated token; the report's "energy" table puts them side by side with llama.cpp's at the same threads.
The governor's paced mode spends its CPU budget on the cheapest of these (governor/limits.pick_config).
Both engines get the same token ids. The known prompt is what a user of this model sends: a chat model's
template rendered around a question, a base model (no template, e.g. Gemma 3 270M) a raw completion prompt.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

LLAMA_HOW = (
    "llama-cpp-python is not installed, so there is no peer in this run. Install it (it compiles "
    "llama.cpp from PyPI's sdist, about 5 minutes on 2 cores): .venv/bin/pip install llama-cpp-python==0.3.36"
)
NUMERIC = (
    "cold_load_s",
    "prompt_tok_s",
    "decode_tok_s_ctx500",
    "decode_tok_s_short",
    "ttft_ms",
    "followup_ttft_ms_reuse",
    "followup_ttft_ms_no_reuse",
    "followup_reuse_ratio",
    "rss_after_1_mb",
    "rss_after_10_mb",
    "rss_growth_pct",
    "peak_rss_mb",
    "cpu_s_per_token",
    "cpu_s_per_token_ctx500",
    "tok_per_cpu_s",
)
SPINS = ("auto", "off")  # auto: the engine's default, which spins a pool while unpaced (as here)


KNOWN_QUESTION = "What is the capital of France?"
KNOWN_COMPLETION = "def fibonacci(n):\n"
PEER = "gguf"  # llama.cpp's configuration label: it runs the GGUF as it is


def known_prompt(model_dir: Path) -> list[int]:
    from models.runtime.chat import ChatTemplate
    from models.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model_dir)
    if tokenizer.chat_template:
        text = ChatTemplate.from_tokenizer(tokenizer).render([{"role": "user", "content": KNOWN_QUESTION}])
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(KNOWN_COMPLETION, add_special_tokens=True)


# one probe's limit: a 1.5B model's probe on two shared cores runs past 10 minutes (0.5B: ~6 at one thread)
PROBE_TIMEOUT_S = 2400


def run_probe(
    cfg: dict[str, Any], timeout: float = PROBE_TIMEOUT_S, module: str = "bench.engine_probe"
) -> dict[str, Any]:
    """One probe in its own process; a failed or stuck one is an error in the report, not the end of it."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", module, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"config": cfg, "error": [f"no result within {timeout:g} s"]}
    if out.returncode != 0:
        return {"config": cfg, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0].get("error"), "runs": 0}
    out: dict[str, Any] = {"runs": len(ok)}
    for key in NUMERIC:
        vals = [r[key] for r in ok if r.get(key) is not None]
        if not vals:
            continue
        out[key] = round(statistics.median(vals), 5 if key.startswith("cpu_s") else 3)
        out[key + "_all"] = vals
    out["greedy_known"] = ok[0]["greedy_known"]
    return out


def simmer_configs(
    model_dir: Path, variants: list[str], threads: list[int], spins: tuple[str, ...] = SPINS
) -> list[dict[str, Any]]:
    """Every simmer configuration the bench runs: variant x threads x spinning (one thread has no pool to
    spin, so it runs once). Speculation on/off is the next dimension: it belongs here, with config_name."""
    out = []
    for v in variants:
        for t in threads:
            for spin in spins if t > 1 else spins[:1]:
                out.append(
                    {
                        "engine": "simmer",
                        "model_dir": str(model_dir),
                        "variant": v,
                        "threads": t,
                        "spin": spin,
                    }
                )
    return out


def config_name(cfg: dict[str, Any]) -> str:
    """simmer:q4-a8:t2 (the default: a spinning pool), simmer:q4-a8:t2:spin-off, llama.cpp:gguf:t2."""
    name = f"{cfg['engine']}:{cfg.get('variant', PEER)}:t{cfg['threads']}"
    spin = cfg.get("spin", "auto")
    return name if spin == "auto" else f"{name}:spin-{spin}"


def bench_engine(
    model_dir: Path,
    gguf: Path,
    variants: list[str],
    threads: list[int],
    reps: int,
    with_llama: bool = True,
    spins: tuple[str, ...] = SPINS,
    energy_only: bool = False,
) -> dict[str, Any]:
    known = known_prompt(model_dir)
    configs = [{**c, "known_ids": known} for c in simmer_configs(model_dir, variants, threads, spins)]
    peer = with_llama and find_spec("llama_cpp") is not None
    extra_bufts = None
    if peer:
        from bench.llama_peer import extra_bufts_work

        extra_bufts = extra_bufts_work(gguf)
        configs += [
            {
                "engine": "llama.cpp",
                "gguf": str(gguf),
                "threads": t,
                "known_ids": known,
                "extra_bufts": extra_bufts,
            }
            for t in threads
        ]
    if energy_only:  # CPU per token alone: a few minutes instead of an hour on a loaded machine
        configs = [{**c, "energy_only": True} for c in configs]
    results: dict[str, list[dict[str, Any]]] = {}
    for rep in range(reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]  # rotate: no fixed position
        for cfg in order:
            name = config_name(cfg)
            print(f"[bench engine] round {rep + 1}/{reps} {name}", file=sys.stderr, flush=True)
            results.setdefault(name, []).append(run_probe(cfg))
    summary = {name: summarize(runs) for name, runs in results.items()}
    report: dict[str, Any] = {
        "bench": "engine",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "model_dir": str(model_dir),
        "gguf": str(gguf),
        "reps": reps,
        "known_prompt_ids": known,
        "results": summary,
    }
    report["quality_and_disk"] = quality_and_disk(model_dir, gguf, variants)
    if peer and not energy_only:
        report["ratios_vs_llama_cpp"] = ratios(summary, variants, threads, report["quality_and_disk"])
    else:
        report["peer"] = LLAMA_HOW
    if peer:
        report["llama_cpp_extra_buffers"] = extra_bufts  # False: AMX faults here, repacking off too
    if not energy_only:
        from bench.kl import bench_kl

        report["kl_vs_fp32_reference"] = bench_kl(model_dir, gguf, variants, max(threads), peer, extra_bufts)
    report["energy"] = energy(summary)
    return report


def quality_and_disk(model_dir: Path, gguf: Path, variants: list[str]) -> dict[str, Any]:
    """What the converter measured at pull time (manifest.json): each variant's KL and top-1 against the fp32
    reference over the fixed quality text, llama.cpp's on the same GGUF and ids (the quality floor, when it
    was measured with llama.cpp), and the bytes on disk each engine reads: a variant's own files (its graph,
    the shared weights file and its own), llama.cpp's the GGUF."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    out: dict[str, Any] = {}
    for v in variants:
        entry = (manifest.get("variants") or {}).get(v) or {}
        files = [model_dir / f for f in entry.get("files", [])]
        quality = entry.get("quality") or {}
        out[v] = {
            "kl_mean": quality.get("kl_mean"),
            "kl_p99": quality.get("kl_p99"),
            "top1_agreement": quality.get("top1_agreement"),
            "disk_mb": round(sum(f.stat().st_size for f in files if f.exists()) / 1e6, 1) if files else None,
        }
    floor = manifest.get("quality_floor") or {}
    out[PEER] = {
        "kl_mean": floor.get("kl_mean") if floor.get("source") == "llama.cpp" else None,
        "kl_p99": floor.get("kl_p99") if floor.get("source") == "llama.cpp" else None,
        "top1_agreement": floor.get("top1_agreement") if floor.get("source") == "llama.cpp" else None,
        "disk_mb": round(gguf.stat().st_size / 1e6, 1) if gguf.exists() else None,
        "floor_source": floor.get("source"),
    }
    out["default_variant"] = manifest.get("default_variant")
    out["refused_variants"] = manifest.get("refused_variants") or {}
    return out


def energy(summary: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds per generated token of every configuration, cheapest first, each beside llama.cpp's at
    the same thread count (tok_per_cpu_s ratio: >= 1 means no more CPU per token than llama.cpp)."""
    rows = {}
    for name, r in summary.items():
        if "cpu_s_per_token" not in r:
            continue
        threads = name.split(":")[2]
        peer = summary.get(f"llama.cpp:{PEER}:{threads}", {})
        rows[name] = {
            "cpu_s_per_token": r["cpu_s_per_token"],
            "tok_per_cpu_s": round(1.0 / r["cpu_s_per_token"], 1),
            "decode_tok_s_short": r.get("decode_tok_s_short"),
            "cpu_s_per_token_ctx500": r.get("cpu_s_per_token_ctx500"),
            "tok_per_cpu_s_vs_llama_cpp": round(peer["cpu_s_per_token"] / r["cpu_s_per_token"], 2)
            if peer.get("cpu_s_per_token") and not name.startswith("llama.cpp")
            else None,
        }
    ordered = dict(sorted(rows.items(), key=lambda kv: kv[1]["cpu_s_per_token"]))
    simmer = [n for n in ordered if n.startswith("simmer:")]
    defaults = [n for n in simmer if ":spin-" not in n]
    return {
        "how": "process CPU seconds (user + system, all threads) per generated token, 128 greedy tokens "
        "after the model's known prompt (known_prompt_ids), prefill excluded; medians over the rounds",
        "configs": ordered,
        "cheapest_simmer": simmer[0] if simmer else None,
        "default_configs_at_least_llama_cpp": {
            n: ordered[n]["tok_per_cpu_s_vs_llama_cpp"] >= 1.0
            for n in defaults
            if ordered[n]["tok_per_cpu_s_vs_llama_cpp"] is not None
        },
    }


def bench_workload(
    model_dir: Path,
    variants: list[str],
    threads: list[int],
    reps: int,
    workload: str,
    max_tokens: int,
    gguf: Path | None = None,
    peers: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Speculation off and on, and the peers, on a workload's tasks (bench/workloads.py): each
    configuration is one process running every engine interleaved task by task (bench/workload_probe.py);
    configurations take turns round by round. Peers by default: llama.cpp plain and with its own prompt
    lookup (when llama-cpp-python is installed and the GGUF is known) and onnxruntime-genai on the same
    variant's graph (when installed)."""
    if peers is None:
        peers = tuple(
            p
            for p, ok in (
                ("llama.cpp", gguf is not None and find_spec("llama_cpp") is not None),
                ("llama.cpp-lookup", gguf is not None and find_spec("llama_cpp") is not None),
                ("genai", find_spec("onnxruntime_genai") is not None),
            )
            if ok
        )
    configs = [
        {
            "model_dir": str(model_dir),
            "variant": v,
            "threads": t,
            "workload": workload,
            "max_tokens": max_tokens,
            "gguf": str(gguf) if gguf else None,
            "peers": list(peers),
        }
        for v in variants
        for t in threads
    ]
    results: dict[str, list[dict[str, Any]]] = {}
    for rep in range(reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for cfg in order:
            name = f"simmer:{cfg['variant']}:t{cfg['threads']}"
            print(
                f"[bench engine --workload {workload}] round {rep + 1}/{reps} {name}",
                file=sys.stderr,
                flush=True,
            )
            results.setdefault(name, []).append(run_probe(cfg, timeout=3600, module="bench.workload_probe"))
    summary = {name: summarize_workload(runs, peers) for name, runs in results.items()}
    return {
        "bench": "engine-workload",
        "workload": workload,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "model_dir": str(model_dir),
        "gguf": str(gguf) if gguf else None,
        "peers": list(peers),
        "reps": reps,
        "max_tokens": max_tokens,
        "results": summary,
    }


def summarize_workload(runs: list[dict[str, Any]], peers: tuple[str, ...]) -> dict[str, Any]:
    """Medians over a configuration's rounds: each engine's decode tok/s and tokens per CPU-second, simmer's
    speculation on/off ratios and simmer (speculation auto) over each peer."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0].get("error"), "runs": 0}
    row: dict[str, Any] = {"runs": len(ok), "speculates": ok[0]["speculates"]}
    row["identical_tokens"] = all(r["identical_tokens"] for r in ok)
    for mode in ("off", "auto", *peers):
        for key in ("decode_tok_s", "tokens_per_cpu_s"):
            row[f"{key}_{mode}"] = round(statistics.median(r[mode][key] for r in ok), 2)
    acc = [r["auto"]["acceptance"] for r in ok if r["auto"]["acceptance"] is not None]
    row["acceptance"] = round(statistics.median(acc), 3) if acc else None
    for key in ("speculation_speedup", "speculation_cpu_ratio"):
        row[key] = round(statistics.median(r[key] for r in ok), 3)
        row[key + "_all"] = [r[key] for r in ok]
    row["vs_peers"] = {
        peer: {
            key: round(statistics.median(r["vs_peers"][peer][key] for r in ok), 3)
            for key in ("decode_tok_s", "tokens_per_cpu_s")
        }
        for peer in peers
    }
    # how far each engine's greedy reply agrees with simmer's plain one, per task (None: all of it)
    row["first_difference_vs_off"] = {
        task: runs_[0]["first_difference_vs_off"] for task, runs_ in ok[0]["tasks"].items()
    }
    row["llama_cpp_lookup_vs_plain"] = {
        task: runs_[0].get("llama_cpp_lookup_vs_plain") for task, runs_ in ok[0]["tasks"].items()
    }
    row["tasks"] = ok[0]["tasks"]
    return row


def ratios(
    summary: dict[str, Any], variants: list[str], threads: list[int], quality: dict[str, Any] | None = None
) -> dict[str, Any]:
    quality = quality or {}
    out: dict[str, Any] = {}
    for t in threads:
        peer = summary.get(f"llama.cpp:{PEER}:t{t}", {})
        if "error" in peer or not peer:
            continue
        for v in variants:
            ours = summary.get(f"simmer:{v}:t{t}", {})
            if "error" in ours or not ours:
                continue
            out[f"{v}:t{t}"] = {
                "prompt_tok_s": round(ours["prompt_tok_s"] / peer["prompt_tok_s"], 2),
                "decode_tok_s_ctx500": round(ours["decode_tok_s_ctx500"] / peer["decode_tok_s_ctx500"], 2),
                "decode_tok_s_short": round(ours["decode_tok_s_short"] / peer["decode_tok_s_short"], 2),
                "ttft": round(ours["ttft_ms"] / peer["ttft_ms"], 2),
                "peak_rss_mb_delta": round(ours["peak_rss_mb"] - peer["peak_rss_mb"], 1),
                "peak_rss_ratio": round(ours["peak_rss_mb"] / peer["peak_rss_mb"], 3),
                "tok_per_cpu_s": round(peer["cpu_s_per_token"] / ours["cpu_s_per_token"], 2)
                if ours.get("cpu_s_per_token") and peer.get("cpu_s_per_token")
                else None,
                "same_greedy_text": ours["greedy_known"] == peer["greedy_known"],
            }
            q, pq = quality.get(v) or {}, quality.get(PEER) or {}
            if q.get("kl_mean") is not None and pq.get("kl_mean") is not None:
                out[f"{v}:t{t}"]["kl_mean_vs_llama_cpp"] = round(q["kl_mean"] / pq["kl_mean"], 3)
                out[f"{v}:t{t}"]["kl_p99_vs_llama_cpp"] = round(q["kl_p99"] / pq["kl_p99"], 3)
    return out


def machine() -> dict[str, Any]:
    import os
    import platform

    import onnxruntime

    info = {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    return info
