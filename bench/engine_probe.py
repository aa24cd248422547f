"""One benchmark run of one engine configuration, in its own process (so RSS and load time are its own).

    python -m bench.engine_probe '{"engine": "simmer", "model_dir": ..., "variant": "q4-a8", "threads": 2}'
    python -m bench.engine_probe '{"engine": "llama.cpp", "gguf": ..., "threads": 2}'
prints one JSON object. Both engines are driven the same way from Python: greedy argmax per token, on the
same token ids (`known_ids` in the config: the model's own known prompt, see bench/engine_bench.py).
A simmer config may also say "spin": "auto" (the default: a pool spins while unpaced) | "on" | "off".

Energy per token: cpu_s_per_token is the process CPU time (user + system, all threads) from the first
generated token to the last, per token, in the 128-token decode after the known prompt (prefill
excluded; _ctx500 after the 500-token prompt). tok_per_cpu_s is its inverse.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

PROMPT_TOKENS = 500
DECODE_TOKENS = 128
# SmolLM2's ChatML question without a system prompt, when the config names none
KNOWN_CHAT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
N_CTX = 2048


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's high-water mark: VmHWM (ru_maxrss carries the forking parent's peak across exec when
    it was larger), ru_maxrss where there is no procfs."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def long_ids(vocab_lo: int = 300, n: int = PROMPT_TOKENS, seed: int = 0) -> list[int]:
    """Token ids of ordinary (non-control) tokens; the same list for both engines."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(vocab_lo, 40000, n)]


class SimmerDriver:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from dataclasses import replace

        from server.serving.engine_config import EngineConfig
        from server.settings import Settings

        # opened as `simmer serve` opens it (EngineConfig), at the peer's context size
        config = replace(
            EngineConfig.from_settings(Settings(), threads=cfg["threads"]),
            context_length=N_CTX,
            spin=cfg.get("spin", "auto"),
        )
        t0 = time.perf_counter()
        self.engine = config.open_dir(Path(cfg["model_dir"]), variant=cfg["variant"])
        self.load_s = time.perf_counter() - t0
        self.cpu_rest = 0.0  # process CPU seconds from the first token to the last, of the last generate()

    def generate(self, ids: list[int], n: int, reuse: bool = True) -> tuple[list[int], float, float]:
        """Returns (tokens, seconds to the first token, seconds for the rest)."""
        from models.protocol import Prompt
        from models.types import FinishEvent, GenerationParams, SamplingParams

        if not reuse:
            self.engine.reset_cache()
        params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = 0.0
        c_first = 0.0
        for ev in self.engine.generate(Prompt(list(ids)), params):
            if isinstance(ev, FinishEvent):
                break
            if not out:
                t_first = time.perf_counter()
                c_first = time.process_time()
            out.append(ev.token_id)
        t_end = time.perf_counter()
        self.cpu_rest = time.process_time() - c_first
        return out, t_first - t0, t_end - t_first

    def greedy_text(self, ids: list[int], n: int) -> str:
        from models.protocol import Prompt
        from models.types import FinishEvent, GenerationParams, SamplingParams

        self.engine.reset_cache()
        text = ""
        for ev in self.engine.generate(
            Prompt(list(ids)), GenerationParams(SamplingParams(temperature=0.0), max_tokens=n)
        ):
            text += ev.text
            if isinstance(ev, FinishEvent):
                break
        return text


class LlamaCppDriver:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from bench.llama_peer import open_llama

        t0 = time.perf_counter()
        self.llm = open_llama(
            cfg["gguf"],
            extra_bufts=cfg.get("extra_bufts"),
            n_ctx=N_CTX,
            n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"],
            n_batch=512,
            verbose=False,
        )
        self.load_s = time.perf_counter() - t0
        self.eos = self.llm.token_eos()
        self.cpu_rest = 0.0

    def _next(self) -> int:
        # the last evaluated position's logits, straight from llama.cpp (no copy into llm.scores)
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def generate(self, ids: list[int], n: int, reuse: bool = True) -> tuple[list[int], float, float]:
        llm = self.llm
        t0 = time.perf_counter()
        # llama.cpp keeps its KV cache: reuse the common prefix exactly as llama-cpp-python's generate() does
        common = 0
        if reuse:
            prev = list(llm._input_ids)
            while common < min(len(prev), len(ids) - 1) and prev[common] == ids[common]:
                common += 1
        llm.n_tokens = common  # eval() drops the KV cache past n_tokens
        llm.eval(ids[common:])
        tok = self._next()
        t_first = time.perf_counter()
        c_first = time.process_time()
        out = [tok]
        for _ in range(n - 1):
            llm.eval([tok])
            tok = self._next()
            out.append(tok)
        t_end = time.perf_counter()
        self.cpu_rest = time.process_time() - c_first
        return out, t_first - t0, t_end - t_first

    def greedy_text(self, ids: list[int], n: int) -> str:
        out, _, _ = self.generate(ids, n, reuse=False)
        if self.eos in out:
            out = out[: out.index(self.eos)]
        return self.llm.detokenize(out).decode("utf-8", errors="replace")


def energy_only(driver: Any, res: dict[str, Any], known: list[int]) -> dict[str, Any]:
    """The CPU per token alone (`"energy_only": true`): warm-up, then the known prompt's decode."""
    driver.generate(known, 8, reuse=False)  # warm-up
    _, _, t_rest = driver.generate(known, DECODE_TOKENS + 1, reuse=False)
    res["decode_tok_s_short"] = round(DECODE_TOKENS / t_rest, 1)
    res["cpu_s_per_token"] = round(driver.cpu_rest / DECODE_TOKENS, 5)
    res["tok_per_cpu_s"] = round(DECODE_TOKENS / driver.cpu_rest, 1) if driver.cpu_rest > 0 else None
    res["greedy_known"] = driver.greedy_text(known, 16)
    return res


def probe(cfg: dict[str, Any]) -> dict[str, Any]:
    rss0 = rss()
    driver = SimmerDriver(cfg) if cfg["engine"] == "simmer" else LlamaCppDriver(cfg)
    res: dict[str, Any] = {"config": cfg, "cold_load_s": round(driver.load_s, 4)}
    known = cfg.get("known_ids") or KNOWN_CHAT
    if cfg.get("energy_only"):
        return energy_only(driver, res, known)
    long = long_ids()
    driver.generate(long[:32], 2, reuse=False)  # warm-up
    _, t_first, _ = driver.generate(long, 1, reuse=False)
    res["prompt_tok_s"] = round(PROMPT_TOKENS / t_first, 1)
    _, _, t_rest = driver.generate(long, DECODE_TOKENS + 1, reuse=False)
    res["decode_tok_s_ctx500"] = round(DECODE_TOKENS / t_rest, 1)
    res["cpu_s_per_token_ctx500"] = round(driver.cpu_rest / DECODE_TOKENS, 5)
    _, _, t_rest = driver.generate(known, DECODE_TOKENS + 1, reuse=False)
    res["decode_tok_s_short"] = round(DECODE_TOKENS / t_rest, 1)
    res["cpu_s_per_token"] = round(driver.cpu_rest / DECODE_TOKENS, 5)
    res["tok_per_cpu_s"] = round(DECODE_TOKENS / driver.cpu_rest, 1) if driver.cpu_rest > 0 else None
    _, t_first, _ = driver.generate(known, 1, reuse=False)
    res["ttft_ms"] = round(t_first * 1000, 2)
    # a follow-up turn: a 400-token conversation plus a reply, then 20 new tokens
    convo = long_ids(n=400, seed=1)
    reply, _, _ = driver.generate(convo, 32, reuse=False)
    follow = convo + reply + long_ids(n=20, seed=2)
    _, with_reuse, _ = driver.generate(follow, 1, reuse=True)
    driver.generate(convo, 32, reuse=False)
    _, without, _ = driver.generate(follow, 1, reuse=False)
    res["followup_ttft_ms_reuse"] = round(with_reuse * 1000, 2)
    res["followup_ttft_ms_no_reuse"] = round(without * 1000, 2)
    res["followup_reuse_ratio"] = round(with_reuse / without, 3)
    # memory over 10 consecutive requests
    sizes = []
    for i in range(10):
        driver.generate(long_ids(n=100, seed=10 + i), 32, reuse=False)
        sizes.append(rss())
    res["rss_after_1_mb"] = round(sizes[0] / 1e6, 1)
    res["rss_after_10_mb"] = round(sizes[-1] / 1e6, 1)
    res["rss_growth_pct"] = round(100 * (sizes[-1] - sizes[0]) / sizes[0], 2)
    res["rss_before_load_mb"] = round(rss0 / 1e6, 1)
    res["peak_rss_mb"] = round(peak_rss() / 1e6, 1)
    res["greedy_known"] = driver.greedy_text(known, 16)
    return res


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
