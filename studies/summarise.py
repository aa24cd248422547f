"""Large recorded results kept as their summaries: a sustained run's per-second `series` thinned.

    python -m studies.summarise [--min-kb 100] [FILE ...]   (default: every JSON under studies/results)

Every key of the report but `series` stays as it was: the summary, the runs, the targets and the envelope
the docs cite. Each run's series (one sample a simulated second) is kept at every `--every`-th second (30),
at every second where the level, the model, the variant or the threads changed (and the second before), and
at the hottest second, one sample a line; what the whole series said is added beside it as `series_summary`
(seconds per level, model, variant and threads; temperature, tok/s, CPU budget and pace min, mean, max),
computed from all the samples before they were dropped. The run's own counts (seconds above T_throttle and
the rest) stay in `runs`; the plots (PNG) stay as the benchmark drew them from the full series. A file
already summarised is left alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CATEGORIES = ("level", "model", "variant", "threads")
NUMBERS = ("temperature", "tok_s", "cpu_budget_cores", "pace_tok_s")


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "min": round(min(values), 4),
        "mean": round(sum(values) / len(values), 4),
        "max": round(max(values), 4),
    }


def summarise_series(samples: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """What one run's series said, from all its samples, and the samples kept."""
    ts = [s["t"] for s in samples]
    steps = Counter(b - a for a, b in itertools.pairwise(ts))
    step = steps.most_common(1)[0][0] if steps else 1
    seconds: dict[str, dict[str, float]] = {}
    for key in CATEGORIES:
        if any(key in s for s in samples):
            per: Counter[str] = Counter()
            for s in samples:
                per[str(s.get(key))] += step
            seconds[key] = dict(per)
    temps = [s["temperature"] for s in samples if isinstance(s.get("temperature"), int | float)]
    summary: dict[str, Any] = {
        "samples": len(samples),
        "t_first": ts[0] if ts else None,
        "t_last": ts[-1] if ts else None,
        "t_step": step,
        "seconds_by": seconds,
        **{key: _stats([s[key] for s in samples if isinstance(s.get(key), int | float)]) for key in NUMBERS},
    }
    if temps:
        hottest = max(range(len(samples)), key=lambda i: samples[i].get("temperature") or float("-inf"))
        summary["t_of_peak_temperature"] = samples[hottest]["t"]
    else:
        hottest = None
    kept = set()
    for i, s in enumerate(samples):
        if i == 0 or i == len(samples) - 1 or (s["t"] - ts[0]) % every == 0:
            kept.add(i)
        elif any(s.get(k) != samples[i - 1].get(k) for k in CATEGORIES):
            kept.update((i - 1, i))
    if hottest is not None:
        kept.add(hottest)
    summary["kept_samples"] = len(kept)
    return {"summary": summary, "kept": [samples[i] for i in sorted(kept)]}


def summarise(path: Path, every: int) -> tuple[int, int] | None:
    """Rewrite one report with its series thinned; (bytes before, bytes after), or None if nothing to do."""
    before = path.stat().st_size
    report = json.loads(path.read_text())
    series = report.get("series")
    if not isinstance(series, dict) or "series_summary" in report:
        return None
    total = sum(len(v) for v in series.values() if isinstance(v, list))
    sums: dict[str, Any] = {
        "how": (
            f"studies/summarise.py: each run's series kept at every {every}th second, where the level, "
            "model, variant or threads changed (and the second before) and at the hottest second; the "
            f"numbers below come from all {total} samples"
        ),
    }
    for run, samples in series.items():
        if not isinstance(samples, list) or not samples:
            continue
        got = summarise_series(samples, every)
        sums[run] = got["summary"]
        series[run] = got["kept"]
    out: dict[str, Any] = {}
    for key, value in report.items():
        out[key] = value
        if key == "series":
            out["series_summary"] = sums
    path.write_text(dumps(out))
    return before, path.stat().st_size


def dumps(report: dict[str, Any]) -> str:
    """As the benchmarks write (indent 2), but each kept sample of a series on one line."""
    lines: dict[str, str] = {}
    series = {}
    for run, samples in report["series"].items():
        series[run] = []
        for sample in samples:
            mark = f"@sample-{len(lines)}@"
            lines[json.dumps(mark)] = json.dumps(sample)
            series[run].append(mark)
    text = json.dumps({**report, "series": series}, indent=2)
    for mark, line in lines.items():
        text = text.replace(mark, line, 1)
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.summarise", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--min-kb", type=float, default=100.0, help="only files at least this large")
    p.add_argument("--every", type=int, default=30, help="keep one sample per this many seconds")
    args = p.parse_args(argv)
    files = args.files or sorted(RESULTS.rglob("*.json"))
    for path in files:
        if path.stat().st_size < args.min_kb * 1024:
            continue
        got = summarise(path, args.every)
        if got:
            print(f"{path.name}: {got[0] / 1024:.0f} KB -> {got[1] / 1024:.0f} KB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
