"""Bar charts of a suite's runs: throughput and cache hit rate per workload x config."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.metrics import BASELINE


def plot_runs(runs: Sequence[dict], path: str, title: str = "") -> None:
    """Write a PNG with three panels: total tok/s (log scale), request throughput relative
    to blockhash, and hit rate (x: best possible). Uses the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    by_key = {(r["workload"], r["config"]): r for r in runs}
    base = {r["workload"]: r["request_throughput"] for r in runs if r["config"] == BASELINE}
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.6 * len(workloads)), 11), sharex=True)
    for j, config in enumerate(configs):
        xs, tput, rel, hit = [], [], [], []
        for i, w in enumerate(workloads):
            r = by_key.get((w, config))
            if r is None:
                continue
            xs.append(i + (j - (len(configs) - 1) / 2) * width)
            tput.append(r["total_throughput"])
            rel.append(r["request_throughput"] / base[w] if w in base else float("nan"))
            hit.append(100 * r["hit_rate"])
        axes[0].bar(xs, tput, width, label=config)
        bars = axes[1].bar(xs, rel, width, label=config)
        axes[1].bar_label(bars, fmt="%.2f", fontsize=7)
        bars = axes[2].bar(xs, hit, width, label=config)
        axes[2].bar_label(bars, fmt="%.0f", fontsize=7)
    best = [next(r for c in configs if (r := by_key.get((w, c)))) for w in workloads]
    axes[2].scatter(
        range(len(workloads)),
        [100 * r["best_hit_rate"] for r in best],
        marker="x",
        color="black",
        label="best possible",
        zorder=3,
    )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("prompt + output tok/s")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel("throughput / blockhash")
    axes[2].set_ylabel("cache hit rate %")
    axes[2].set_ylim(0, 119)
    axes[2].set_xticks(range(len(workloads)), workloads, rotation=20, ha="right")
    axes[0].legend(ncol=len(configs), fontsize=8)
    axes[2].legend(fontsize=8, loc="upper center", ncol=len(configs) + 1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import json
    import sys

    src = sys.argv[1]  # a suite JSON written by bench_serving
    with open(src) as f:
        plot_runs(json.load(f)["runs"], src.removesuffix(".json") + ".png", src)
