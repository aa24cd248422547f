"""Markdown tables for the README, made from the benchmarks' JSON (python -m bench.report FILE.json)."""

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


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    print(engine_table(data) if data.get("bench") == "engine" else json.dumps(data, indent=2))
