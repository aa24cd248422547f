"""Where one decode step's wall time goes, simmer against llama.cpp on the same GGUF, interleaved.

    python -m studies.experiments.decode_steps MODEL_DIR GGUF [--variant q4-a8] [--threads 2] [--rounds 3]
        [--out F.json]

Each probe runs in its own process (bench/engine_probe.py's drivers, so both engines are opened and driven
as `simmer bench engine` does them): warm-up, then the 500-token prompt and 128 greedy tokens. simmer's
step splits into
  - run_with_iobinding: onnxruntime's own Run (the graph, its thread pool, its output copies);
  - session: DecoderSession.run around it (binding the token, the mask view);
  - outside: everything else the engine does per token (sampling over the vocabulary, stop checks,
    detokenizing, KV bookkeeping, the step hook), as the step's wall time minus the session's.
llama.cpp's splits into llama_decode's own time (llama_perf_context t_eval_ms) and the rest (the
llama-cpp-python wrapper and the argmax the driver does). A profiled simmer probe (onnxruntime's
enable_profiling) sums the kernels' time per op type in the decode runs, the head's MatMulNBits slices
and its Concat apart; profiling slows every node a little, so read its shares, not its milliseconds.

What it found on Gemma 3 270M q4-a8
(studies/results/experiments/decode-steps-*-shared-2026-12-01.json, a shared machine): Python outside the
session ~0.25 ms a token (sampling most of it), the session's own Python
~0.09 ms, onnxruntime between its kernels ~2.5 % of a run; of the kernels, the weights' MatMulNBits ~75 %,
GroupQueryAttention ~12 % (at 500 tokens), the ~400 small nodes (norms, Reshape, Split, the Q4_K block-sum
MatMul + correction Gemm, FastGelu, Mul) ~14 %, the head's Concat 0.3 %. The quiet run's gap to llama.cpp
is larger at a short context (0.83x) than at 500 tokens (0.88x), so it is not attention; it matches the
bytes each engine streams per token: the layers' Q5_0/Q6_K/Q4_K tensors as MatMulNBits codes, fp32
scales and corrections are ~105 MB against the GGUF's 68 MB (plus 7 MB of 0/1 block-indicator matrices
read by the Q4_K block sums), the head ~189 MB (fp32 scales) against 178 MB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.engine_bench import known_prompt, machine, run_probe
from bench.engine_probe import DECODE_TOKENS, PROMPT_TOKENS, LlamaCppDriver, SimmerDriver, long_ids


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3)


def _simmer(cfg: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    from models.runtime import session as session_mod

    if cfg.get("profile"):
        plain = session_mod.session_options

        def profiled(threads: int, spinning: bool = False) -> ort.SessionOptions:
            so = plain(threads, spinning)
            so.enable_profiling = True
            so.profile_file_prefix = cfg["profile"]
            return so

        session_mod.session_options = profiled  # type: ignore[assignment]
    driver = SimmerDriver(cfg)
    engine = driver.engine
    sess = engine.session()
    runs: list[float] = []  # seconds inside run_with_iobinding, per call
    calls: list[float] = []  # seconds inside DecoderSession.run, per call
    inner = sess.sess

    class TimedSession:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def run_with_iobinding(self, *a: Any) -> Any:
            t0 = time.perf_counter()
            out = inner.run_with_iobinding(*a)
            runs.append(time.perf_counter() - t0)
            return out

    sess.sess = TimedSession()  # type: ignore[assignment]
    outer = sess.run_last

    def timed_run_last(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = outer(*a, **k)
        calls.append(time.perf_counter() - t0)
        return out

    sess.run_last = timed_run_last  # type: ignore[method-assign]
    prompt = long_ids(n=cfg.get("prompt_tokens", PROMPT_TOKENS))
    driver.generate(prompt[:32], 8, reuse=False)  # warm-up
    out: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if k != "known_ids"}}
    n_runs = len(runs)
    from models.protocol import Prompt
    from models.types import FinishEvent, GenerationParams, SamplingParams

    engine.reset_cache()
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    stamps: list[float] = []
    for ev in engine.generate(Prompt(list(prompt)), params):
        if isinstance(ev, FinishEvent):
            break
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    # decode calls only: the prefill's chunks come first
    dec_runs = runs[n_runs:][-len(steps) :]
    dec_calls = calls[-len(steps) :]
    out["tokens"] = len(steps)
    out["step_ms"] = _median_ms(steps)
    out["step_ms_mean"] = round(sum(steps) / len(steps) * 1000, 3)
    out["run_with_iobinding_ms"] = _median_ms(dec_runs)
    out["session_run_ms"] = _median_ms(dec_calls)
    out["session_python_ms"] = _median_ms([c - r for c, r in zip(dec_calls, dec_runs, strict=True)])
    out["outside_session_ms"] = _median_ms([s - c for s, c in zip(steps, dec_calls, strict=True)])
    out["decode_tok_s"] = round(len(steps) / sum(steps), 2)
    if cfg.get("profile"):
        out["profile"] = _profile_summary(inner.end_profiling(), len(steps), sess.path)
    return out


def _tensor_kind(weight: str) -> str:
    """blk.3.ffn_down.q8b16.qweight -> ffn_down"""
    parts = weight.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]


def _profile_summary(path: str, decode_runs: int, model: Path) -> dict[str, Any]:
    """Kernel time per op type (MatMulNBits by tensor, the head's slices and their Concat apart) over the
    last `decode_runs` model runs, in ms per run."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    weights = {n.name: n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    head_concat = {
        n.name
        for n in graph.node
        if n.op_type == "Concat"
        and all(weights.get(_producer(graph, i), "").startswith("token_embd") for i in n.input)
    }
    events = json.loads(Path(path).read_text())
    Path(path).unlink()
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[
        -decode_runs:
    ]
    lo = model_runs[0]["ts"]
    per: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < lo:
            continue
        op = e["args"].get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        key = op
        if op == "MatMulNBits":
            w = weights.get(node, "?")
            key = "MatMulNBits head" if w.startswith("token_embd") else "MatMulNBits " + _tensor_kind(w)
        elif op == "Concat" and node in head_concat:
            key = "Concat (head slices)"
        per[key] += e["dur"] / 1000
    run_ms = statistics.median(e["dur"] / 1000 for e in model_runs)
    kernels = sum(per.values()) / len(model_runs)
    return {
        "model_run_ms": round(run_ms, 3),
        "kernels_ms": round(kernels, 3),
        "per_op_ms": {
            k: round(v / len(model_runs), 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])
        },
    }


def _producer(graph: Any, output: str) -> str:
    return next((n.name for n in graph.node if output in n.output), "")


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    driver = LlamaCppDriver(cfg)
    llm = driver.llm
    prompt = long_ids(n=cfg.get("prompt_tokens", PROMPT_TOKENS))
    driver.generate(prompt[:32], 8, reuse=False)  # warm-up
    llm.n_tokens = 0
    llm.eval(prompt)
    tok = driver._next()
    ctx = llm._ctx.ctx
    llama_cpp.llama_perf_context_reset(ctx)
    steps = []
    evals = []
    for _ in range(DECODE_TOKENS):
        t0 = time.perf_counter()
        llm.eval([tok])
        t1 = time.perf_counter()
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        steps.append(time.perf_counter() - t0)
        evals.append(t1 - t0)
    perf = llama_cpp.llama_perf_context(ctx)
    decode_ms = perf.t_eval_ms / max(perf.n_eval, 1)
    return {
        "config": {k: v for k, v in cfg.items() if k != "known_ids"},
        "tokens": len(steps),
        "step_ms": _median_ms(steps),
        "step_ms_mean": round(sum(steps) / len(steps) * 1000, 3),
        "eval_call_ms": _median_ms(evals),
        "llama_decode_ms_mean": round(decode_ms, 3),
        "n_eval": perf.n_eval,
        "outside_eval_ms": _median_ms([s - e for s, e in zip(steps, evals, strict=True)]),
        "decode_tok_s": round(len(steps) / sum(steps), 2),
    }


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    return _simmer(cfg) if cfg["engine"] == "simmer" else _llama(cfg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--variant", default="q4-a8")
    ap.add_argument(
        "--variants", default=None, help="comma-separated model dirs=labels to A/B (dir=label,...)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="context before decoding")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    known = known_prompt(args.model_dir)
    simmers = [("simmer", args.model_dir)]
    if args.variants:
        simmers = [(label, Path(d)) for d, label in (x.split("=") for x in args.variants.split(","))]
    configs = [
        {
            "engine": "simmer",
            "label": label,
            "model_dir": str(d),
            "variant": args.variant,
            "threads": args.threads,
            "known_ids": known,
            "prompt_tokens": args.prompt_tokens,
        }
        for label, d in simmers
    ] + [
        {
            "engine": "llama.cpp",
            "label": "llama.cpp",
            "gguf": str(args.gguf),
            "threads": args.threads,
            "prompt_tokens": args.prompt_tokens,
        }
    ]
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        for cfg in order:
            print(f"[decode_steps] round {rnd + 1}/{args.rounds} {cfg['label']}", file=sys.stderr, flush=True)
            results[cfg["label"]].append(run_probe(cfg, module="studies.experiments.decode_steps"))
    profiles = {}
    if not args.no_profile:
        for label, _d in simmers:
            cfg = {
                **configs[[c["label"] for c in configs].index(label)],
                "profile": f"/tmp/decode_steps_{label}",
            }
            print(f"[decode_steps] profiled {label}", file=sys.stderr, flush=True)
            profiles[label] = run_probe(cfg, module="studies.experiments.decode_steps")
    summary = {}
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        keys = [
            k
            for k in (ok[0] if ok else {})
            if k.endswith("_ms") or k.endswith("_mean") or k == "decode_tok_s"
        ]
        summary[label] = {k: round(statistics.median(r[k] for r in ok), 3) for k in keys}
        summary[label]["all"] = runs
    report = {
        "bench": "decode_steps",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "note": "shared machine (other jobs on the 2 cores): read ratios, not absolute numbers",
        "rounds": args.rounds,
        "summary": summary,
        "profiles": profiles,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(probe(json.loads(sys.argv[1]))))
    else:
        main()
