"""Rows of the program suite: the markdown table, the targets and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

HIT_OF_OPTIMAL = 0.96  # radix hit rate / the optimum, every program
FORK_SPEEDUP = 2.0  # sequential OpenAI loop latency / DSL latency, fork-heavy programs
RADIX_VS_BLOCKHASH = 0.98  # radix programs/s / block-hash programs/s, every program

HEADER = (
    "| program | config | programs/s | spread | latency s | calls | prompt tok | computed "
    "| hit % | optimal % | hit / optimal | same calls |"
)


def median_rows(rows: Sequence[dict]) -> list[dict]:
    """One row per (program, config): the run of median programs/s, with every run's
    programs/s in `programs_per_s_runs` and (max - min) / median in `spread` (0 for one run).
    Single runs on a shared CPU differ by up to 2x; compare medians and read the spread."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["program"], r["config"]), []).append(r)
    out = []
    for group in groups.values():
        rates = [r["programs_per_s"] for r in group]
        mid = statistics.median_low(rates)
        pick = next(r for r in group if r["programs_per_s"] == mid)
        spread = (max(rates) - min(rates)) / mid if mid > 0 else 0.0
        out.append({**pick, "programs_per_s_runs": rates, "spread": spread})
    return out


def format_table(rows: Sequence[dict]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['program']} | {r['config']} | {r['programs_per_s']:.2f} "
            f"| {100 * r.get('spread', 0.0):.0f}% "
            f"| {_num(r['latency_s'], '.3f')} | {r['calls']} | {r['prompt_tokens']} "
            f"| {r['prompt_tokens_computed']} | {100 * r['hit_rate']:.1f} "
            f"| {100 * r['optimal_hit_rate']:.1f} | {_num(r['hit_over_optimal'], '.3f')} "
            f"| {'yes' if r['same_calls'] else 'NO'} |"
        )
    return "\n".join(lines)


def check_targets(rows: Sequence[dict], fork_heavy: set[str]) -> list[dict]:
    """{"status": PASS | FAIL | SKIP, "text"} per target and program (SKIP: a config of
    the comparison was not run)."""
    by = {(r["program"], r["config"]): r for r in rows}
    programs = list(dict.fromkeys(r["program"] for r in rows))
    out: list[dict] = []

    def add(ok: bool | None, text: str) -> None:
        out.append({"status": "SKIP" if ok is None else "PASS" if ok else "FAIL", "text": text})

    for p in programs:
        radix, bh = by.get((p, "radix")), by.get((p, "blockhash"))
        x = radix and radix["hit_over_optimal"]
        add(None if x is None else x >= HIT_OF_OPTIMAL,
            f"{p}: radix hit rate / optimal {_num(x, '.3f')} (>= {HIT_OF_OPTIMAL})")  # fmt: skip
        x = radix["programs_per_s"] / bh["programs_per_s"] if radix and bh else None
        add(None if x is None else x >= RADIX_VS_BLOCKHASH,
            f"{p}: radix / block-hash programs/s {_num(x, '.3f')} "
            f"(>= {RADIX_VS_BLOCKHASH})")  # fmt: skip
        if p not in fork_heavy:
            continue
        dsl, seq, asy = (by.get((p, c)) for c in ("dsl-http", "openai-seq", "openai-async"))
        x = seq["latency_s"] / dsl["latency_s"] if dsl and seq else None
        add(None if x is None else x >= FORK_SPEEDUP,
            f"{p}: latency sequential OpenAI loop / DSL {_num(x, '.2f')} "
            f"(>= {FORK_SPEEDUP})")  # fmt: skip
        x = dsl["latency_s"] / asy["latency_s"] if dsl and asy else None
        add(None if x is None else x <= 1.0,
            f"{p}: latency DSL / asyncio OpenAI client {_num(x, '.2f')} (<= 1.0)")  # fmt: skip
    return out


def plot_rows(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Two panels: hit rate / optimal, and programs/s relative to the radix config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    programs = list(dict.fromkeys(r["program"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["program"], r["config"]): r for r in rows}
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(2, 1, figsize=(max(9, 1.4 * len(programs)), 8), sharex=True)
    for j, c in enumerate(configs):
        xs, hit, rel = [], [], []
        for i, p in enumerate(programs):
            r, base = by.get((p, c)), by.get((p, "radix"))
            if r is None:
                continue
            xs.append(i + (j - (len(configs) - 1) / 2) * width)
            hit.append(r["hit_over_optimal"] or 0.0)
            rel.append(r["programs_per_s"] / base["programs_per_s"] if base else float("nan"))
        axes[0].bar(xs, hit, width, label=c)
        axes[1].bar(xs, rel, width, label=c)
    axes[0].axhline(HIT_OF_OPTIMAL, color="black", lw=0.8, ls="--")
    axes[0].set_ylabel("hit rate / optimal")
    axes[0].set_ylim(0, 1.1)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel("programs/s / radix")
    axes[1].set_xticks(range(len(programs)), programs, rotation=20, ha="right")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(10, len(configs)), fontsize=8,
               bbox_to_anchor=(0.5, 0.965))  # fmt: skip
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)
