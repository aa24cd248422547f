"""The runs as a figure: temperature, tok/s, level and threads against simulated time."""

from __future__ import annotations

from typing import Any

from bench.sustained.measure import LEVEL_INDEX


def plot_runs(
    runs: dict[str, dict[str, Any]],
    path: str,
    *,
    profile: str,
    time_scale: float,
    title: str = "governed vs ungoverned",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    colors = {
        "governed": "tab:blue",
        "ungoverned": "tab:red",
        "levels": "tab:green",
        "offload": "tab:green",
        "no_offload": "tab:red",
        "ladder": "tab:blue",
        "variants": "tab:orange",
    }
    for name, run in runs.items():
        s = run["series"]
        t = [p["t"] for p in s]
        temp = [p["temperature"] for p in s]
        axes[0].plot(t, temp, color=colors[name], label=name)
        window = 10
        raw = [p["tok_s"] for p in s]
        smooth = [
            sum(raw[max(0, i - window + 1) : i + 1]) / len(raw[max(0, i - window + 1) : i + 1])
            for i in range(len(raw))
        ]
        axes[1].plot(
            t, smooth, color=colors[name], label=f"{name} ({run['tok_s_last_5min']} tok/s last 5 min)"
        )
        axes[2].step(
            t,
            [LEVEL_INDEX.get(p["level"]) if p["level"] else None for p in s],
            color=colors[name],
            where="post",
            label=name,
        )
        axes[3].step(t, [p["threads"] for p in s], color=colors[name], where="post", label=f"{name} threads")
    first = next(iter(runs.values()))
    if first["throttle_c"]:
        axes[0].axhline(first["throttle_c"], color="orange", linestyle="--", label="T_throttle")
    if first["critical_c"]:
        axes[0].axhline(first["critical_c"], color="black", linestyle=":", label="T_critical")
    axes[0].set_ylabel("skin temperature (C)")
    axes[1].set_ylabel("tok/s (10 s mean)")
    axes[2].set_ylabel("level")
    axes[2].set_yticks(range(4), list(LEVEL_INDEX))
    axes[3].set_ylabel("threads")
    axes[3].set_xlabel(f"simulated seconds (time_scale {time_scale:g})")
    for ax in axes:
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"simmer sustained benchmark: sim:{profile}, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
