"""Markdown tables for the docs, made from the benchmarks' JSON: `python -m bench.report FILE.json`, and
`python -m bench.report --variants A.json B.json ...` for the variants of several models
(docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ENGINE_COLUMNS = (
    ("prompt_tok_s", "prompt tok/s (500 tok)"),
    ("decode_tok_s_ctx500", "decode tok/s at ctx 500"),
    ("decode_tok_s_short", "decode tok/s, short ctx"),
    ("ttft_ms", "TTFT ms"),
    ("followup_ttft_ms_reuse", "follow-up TTFT ms, reuse"),
    ("followup_ttft_ms_no_reuse", "... without reuse"),
    ("cold_load_s", "cold load s"),
    ("peak_rss_mb", "peak RSS MB"),
    ("rss_growth_pct", "RSS growth, 10 req %"),
)


def engine_table(report: dict[str, Any]) -> str:
    head = "| engine:variant:threads | " + " | ".join(title for _, title in ENGINE_COLUMNS) + " |"
    rows = [head, "|---" * (len(ENGINE_COLUMNS) + 1) + "|"]
    for name, r in report["results"].items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error']} |")
            continue
        rows.append(f"| {name} | " + " | ".join(f"{r[key]:g}" for key, _ in ENGINE_COLUMNS) + " |")
    ratios = report.get("ratios_vs_llama_cpp") or {}
    if ratios:
        rows += [
            "",
            "| simmer / llama.cpp | prompt | decode ctx 500 | decode short | TTFT | peak RSS MB delta "
            "| same greedy text |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in ratios.items():
            rows.append(
                f"| {name} | {r['prompt_tok_s']}x | {r['decode_tok_s_ctx500']}x | {r['decode_tok_s_short']}x "
                f"| {r['ttft']}x | {r['peak_rss_mb_delta']:+g} | {r['same_greedy_text']} |"
            )
    return "\n".join(rows)


def _x(ours: float | None, peer: float | None, digits: int = 1) -> str:
    """`41.2 vs 38.0 (1.08x)`: both values and their ratio."""
    if ours is None or peer is None:
        return "-"
    return f"{ours:.{digits}f} vs {peer:.{digits}f} ({ours / peer:.2f}x)" if peer else f"{ours:.{digits}f}"


def variants_table(reports: list[dict[str, Any]], threads: int = 2) -> str:
    """One row per model and variant against llama.cpp on the same GGUF, from several `simmer bench engine`
    reports (one per model): decode at a short context and at 500, tokens per CPU-second, prompt, TTFT, peak
    RSS, disk and KL (mean, p99) against the fp32 reference, each as ours vs llama.cpp's (ratio)."""
    rows = [
        "| model | variant | decode short tok/s | decode ctx 500 tok/s | tokens per CPU-s | prompt tok/s "
        "| TTFT ms | peak RSS MB | disk MB | KL mean | KL p99 |",
        "|---" * 11 + "|",
    ]
    for rep in reports:
        res, qd = rep["results"], rep.get("quality_and_disk") or {}
        peer = res.get(f"llama.cpp:gguf:t{threads}") or {}
        pq = qd.get("gguf") or {}
        model = Path(rep["model_dir"]).name
        for name, r in res.items():
            if not name.startswith("simmer:") or not name.endswith(f":t{threads}") or "error" in r:
                continue
            v = name.split(":")[1]
            q = qd.get(v) or {}
            tag = f"{v} (default)" if qd.get("default_variant") == v else v
            cpu = 1 / r["cpu_s_per_token"] if r.get("cpu_s_per_token") else None
            peer_cpu = 1 / peer["cpu_s_per_token"] if peer.get("cpu_s_per_token") else None
            cells = [
                _x(r.get("decode_tok_s_short"), peer.get("decode_tok_s_short")),
                _x(r.get("decode_tok_s_ctx500"), peer.get("decode_tok_s_ctx500")),
                _x(cpu, peer_cpu),
                _x(r.get("prompt_tok_s"), peer.get("prompt_tok_s")),
                _x(r.get("ttft_ms"), peer.get("ttft_ms")),
                _x(r.get("peak_rss_mb"), peer.get("peak_rss_mb")),
                _x(q.get("disk_mb"), pq.get("disk_mb")),
                _x(q.get("kl_mean"), pq.get("kl_mean"), 5),
                _x(q.get("kl_p99"), pq.get("kl_p99"), 4),
            ]
            rows.append(f"| {model} | {tag} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1] == "--variants":
        print(variants_table([json.loads(Path(f).read_text()) for f in sys.argv[2:]]))
        sys.exit(0)
    data = json.loads(Path(sys.argv[1]).read_text())
    print(engine_table(data) if data.get("bench") == "engine" else json.dumps(data, indent=2))
