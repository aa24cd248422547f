"""One process, one variant and thread count, speculation off and on (and the peers) interleaved task by task:

    python -m bench.workload_probe '{"model_dir": ..., "variant": "q4", "threads": 1, "workload": "rewrite",
                                      "gguf": ..., "peers": ["llama.cpp", "llama.cpp-lookup", "genai"]}'
prints one JSON object. Every engine runs in this process, so the machine's drift (15-20 % over minutes
here) falls on all alike; the order rotates every task. Greedy, up to `max_tokens` per task, stopping at
the model's end-of-generation ids: simmer's two replies must be token for token the same, and the report
says whether they were and where each peer's reply first differs from simmer's.

The peers (`peers`, each optional):
- `llama.cpp`: llama-cpp-python's Llama.generate() on the GGUF, greedy;
- `llama.cpp-lookup`: the same with its own prompt lookup (draft_model=LlamaPromptLookupDecoding(), its
  defaults: 10 drafted tokens, n-grams up to 2), which verifies drafts in one batch;
- `genai`: onnxruntime-genai on our own converted folder, the same variant's graph (its greedy search).
All are timed alike from the outside: decode = the tokens after the first over the time after the first
token arrived; CPU = the process's CPU time over the whole request (prefill included, all threads).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("off", "auto")
PEERS = ("llama.cpp", "llama.cpp-lookup", "genai")
MAX_TOKENS = 160
N_CTX = 2048


def _timed(tokens: Any, eos: set[int], max_tokens: int) -> dict[str, Any]:
    """Drain a token iterator (stopping at EOS or max_tokens), timed from the outside."""
    out: list[int] = []
    c0 = time.process_time()
    t_first = t_end = time.perf_counter()
    for tok in tokens:
        if tok in eos:
            break
        out.append(tok)
        t_end = time.perf_counter()
        if len(out) == 1:
            t_first = t_end
        if len(out) >= max_tokens:
            break
    return {
        "tokens": out,
        "decode_s": t_end - t_first,  # for len(out) - 1 tokens
        "cpu_s": time.process_time() - c0,
        "draft_n": 0,
        "draft_n_accepted": 0,
    }


class Simmer:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.eos = set(engine.tokenizer.eos_ids)

    def run(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        from models.protocol import Prompt
        from models.types import FinishEvent, GenerationParams, SamplingParams

        self.engine.reset_cache()  # every task from a cold KV: prefix reuse is not what this measures
        params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens)
        fin: list[Any] = []

        def tokens() -> Any:
            for ev in self.engine.generate(Prompt(list(ids)), params):
                if isinstance(ev, FinishEvent):
                    fin.append(ev)
                else:
                    yield ev.token_id

        r = _timed(tokens(), set(), max_tokens + 1)  # drained to its FinishEvent: the engine stops itself
        if fin:
            r["draft_n"], r["draft_n_accepted"] = fin[0].timings.draft_n, fin[0].timings.draft_n_accepted
        return r


class LlamaCpp:
    def __init__(
        self,
        gguf: str,
        threads: int,
        n_ctx: int,
        eos: set[int],
        lookup: bool,
        extra_bufts: bool | None = None,
    ) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from bench.llama_peer import open_llama

        self.llm = open_llama(
            gguf,
            extra_bufts=extra_bufts,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            draft_model=LlamaPromptLookupDecoding() if lookup else None,
            # a draft model turns logits_all on by itself but sizes the logits buffer by the argument
            # (n_batch rows): a draft past position 512 overflows it (llama-cpp-python 0.3.36)
            logits_all=lookup,
            verbose=False,
        )
        self.eos = eos | {self.llm.token_eos()}

    def run(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        self.llm.reset()  # a cold KV cache, as simmer's
        gen = self.llm.generate(list(ids), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)
        return _timed((int(t) for t in gen), self.eos, max_tokens)


class Genai:
    def __init__(self, model_dir: Path, variant: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        session = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(
            json.dumps({"model": {"decoder": {"filename": f"{variant}.onnx", "session_options": session}}})
        )
        self.model = og.Model(config)

    def run(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_tokens, batch_size=1)

        def tokens() -> Any:
            gen = og.Generator(self.model, params)
            gen.append_tokens(list(ids))
            while not gen.is_done():
                gen.generate_next_token()
                yield int(gen.get_next_tokens()[0])

        return _timed(tokens(), set(), max_tokens)  # genai stops at its own EOS ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two replies differ (None: the same)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    from bench.workloads import workload_prompts
    from models.runtime.engine import load_engine

    model_dir = Path(cfg["model_dir"])
    n_ctx = int(cfg.get("n_ctx", N_CTX))
    drivers: dict[str, Any] = {
        mode: Simmer(
            load_engine(
                model_dir,
                variant=cfg["variant"],
                threads=cfg["threads"],
                context_length=n_ctx,
                speculation=mode,
            )
        )
        for mode in MODES
    }
    speculates = drivers["auto"].engine.speculates
    eos = drivers["off"].eos
    for peer in cfg.get("peers", ()):
        if peer == "genai":
            drivers[peer] = Genai(model_dir, cfg["variant"], cfg["threads"])
        elif peer in ("llama.cpp", "llama.cpp-lookup"):
            drivers[peer] = LlamaCpp(cfg["gguf"], cfg["threads"], n_ctx, eos, peer == "llama.cpp-lookup")
        else:
            raise ValueError(f"unknown peer {peer!r}; known: {PEERS}")
    modes = list(drivers)
    prompts = workload_prompts(model_dir, cfg["workload"])
    if cfg.get("prompt_tail"):  # a model with a short context (the tests' tiny one): the prompts' tails
        prompts = {name: ids[-int(cfg["prompt_tail"]) :] for name, ids in prompts.items()}
    max_tokens = int(cfg.get("max_tokens", MAX_TOKENS))
    for driver in drivers.values():  # warm-up
        driver.run(next(iter(prompts.values()))[:64], 8)
    totals = {
        m: {
            "tokens": 0,
            "decode_tokens": 0,
            "decode_s": 0.0,
            "cpu_s": 0.0,
            "draft_n": 0,
            "draft_n_accepted": 0,
        }
        for m in modes
    }
    identical = True
    tasks: dict[str, Any] = {}
    turn = 0
    for _rep in range(int(cfg.get("reps", 1))):
        for name, ids in prompts.items():
            order = modes[turn % len(modes) :] + modes[: turn % len(modes)]  # rotate: no fixed position
            turn += 1
            runs = {mode: drivers[mode].run(ids, max_tokens) for mode in order}
            same = runs["off"]["tokens"] == runs["auto"]["tokens"]
            identical &= same
            for mode, r in runs.items():
                tot = totals[mode]
                tot["tokens"] += len(r["tokens"])
                tot["decode_tokens"] += max(len(r["tokens"]) - 1, 0)
                for key in ("decode_s", "cpu_s", "draft_n", "draft_n_accepted"):
                    tot[key] += r[key]
            tasks.setdefault(name, []).append(
                {
                    "tokens": {m: len(r["tokens"]) for m, r in runs.items()},
                    "identical": same,
                    "first_difference_vs_off": {
                        m: first_difference(runs["off"]["tokens"], r["tokens"])
                        for m, r in runs.items()
                        if m != "off"
                    },
                    # llama.cpp's own prompt lookup against its own plain decode (None: the same reply)
                    "llama_cpp_lookup_vs_plain": first_difference(
                        runs["llama.cpp"]["tokens"], runs["llama.cpp-lookup"]["tokens"]
                    )
                    if {"llama.cpp", "llama.cpp-lookup"} <= runs.keys()
                    else None,
                    "sha1_off": hashlib.sha1(json.dumps(runs["off"]["tokens"]).encode()).hexdigest()[:12],
                    "decode_tok_s": {
                        m: round(max(len(r["tokens"]) - 1, 0) / max(r["decode_s"], 1e-9), 1)
                        for m, r in runs.items()
                    },
                    "acceptance": round(
                        runs["auto"]["draft_n_accepted"] / max(runs["auto"]["draft_n"], 1), 3
                    ),
                }
            )
    res: dict[str, Any] = {
        "config": cfg,
        "speculates": speculates,
        "identical_tokens": identical,
        "tasks": tasks,
    }
    for mode, tot in totals.items():
        res[mode] = {
            "tokens": tot["tokens"],
            "decode_tok_s": round(tot["decode_tokens"] / max(tot["decode_s"], 1e-9), 2),
            "tokens_per_cpu_s": round(tot["tokens"] / max(tot["cpu_s"], 1e-9), 2),
            "draft_n": tot["draft_n"],
            "draft_n_accepted": tot["draft_n_accepted"],
            "acceptance": round(tot["draft_n_accepted"] / tot["draft_n"], 3) if tot["draft_n"] else None,
        }
    res["speculation_speedup"] = round(res["auto"]["decode_tok_s"] / res["off"]["decode_tok_s"], 3)
    res["speculation_cpu_ratio"] = round(res["auto"]["tokens_per_cpu_s"] / res["off"]["tokens_per_cpu_s"], 3)
    # simmer (speculation auto) against each peer, same run: > 1 means simmer is faster / cheaper
    res["vs_peers"] = {
        peer: {
            "decode_tok_s": round(res["auto"]["decode_tok_s"] / res[peer]["decode_tok_s"], 3),
            "tokens_per_cpu_s": round(res["auto"]["tokens_per_cpu_s"] / res[peer]["tokens_per_cpu_s"], 3),
        }
        for peer in modes
        if peer not in MODES
    }
    return res


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
