"""The benchmark suite's targets, checked against a suite's runs (and the HF baseline)."""

from __future__ import annotations

from collections.abc import Sequence

RADIX, BLOCKHASH, NONE = "radix+lpm", "blockhash+fcfs", "none+fcfs"  # the compared configs
MIN_RATIO = 0.98  # radix vs blockhash on every workload; radix vs none on random
PRESSURE_RATIO = 1.3  # radix vs blockhash on a memory-pressured multi-turn or agent run
SHARED_PREFIX_HIT = 0.87
HF_RATIO = 10.0  # radix output tok/s on random vs the HF transformers baseline


def check_targets(runs: Sequence[dict], hf: dict | None = None) -> list[dict]:
    """One {"status": PASS | FAIL | SKIP, "text": ...} per target; runs that hit their
    timeout count as missing."""
    ok = {(r["workload"], r["config"]): r for r in runs if r["complete"]}
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    out: list[dict] = []

    def add(passed: bool | None, text: str) -> None:
        out.append({"status": "SKIP" if passed is None else "PASS" if passed else "FAIL",
                    "text": text})  # fmt: skip

    def ratio(w: str, a: str, b: str) -> float | None:
        if (w, a) in ok and (w, b) in ok:
            return ok[w, a]["request_throughput"] / ok[w, b]["request_throughput"]
        return None

    for w in workloads:
        x = ratio(w, RADIX, BLOCKHASH)
        add(None if x is None else x >= MIN_RATIO,
            f"{w}: radix / blockhash throughput {_fmt(x)} (target >= {MIN_RATIO})")  # fmt: skip
    pressured = {w: ratio(w, RADIX, BLOCKHASH) for w in workloads if "@kv" in w}
    best = max((x for x in pressured.values() if x is not None), default=None)
    add(None if best is None else best >= PRESSURE_RATIO,
        "memory pressure: best radix / blockhash throughput "
        + (", ".join(f"{w} {_fmt(x)}" for w, x in pressured.items()) or "n/a")
        + f" (target >= {PRESSURE_RATIO} on one)")  # fmt: skip
    sp = ok.get(("shared-prefix", RADIX))
    add(None if sp is None else sp["hit_rate"] >= SHARED_PREFIX_HIT,
        f"shared-prefix radix hit rate {_pct(sp)} (best possible "
        f"{_pct(sp, 'best_hit_rate')}, target >= {100 * SHARED_PREFIX_HIT:.0f}%)")  # fmt: skip
    x = ratio("random", RADIX, NONE)
    add(None if x is None else x >= MIN_RATIO,
        f"random: radix / none throughput {_fmt(x)} (target >= {MIN_RATIO})")  # fmt: skip
    if hf is not None:
        rnd = ok.get(("random", RADIX))
        x = rnd["output_throughput"] / hf["output_throughput"] if rnd else None
        add(None if x is None else x >= HF_RATIO,
            f"random: radix {_fmt(rnd and rnd['output_throughput'], '.0f')} out tok/s vs HF "
            f"transformers {hf['output_throughput']:.0f} (batch {hf['batch_size']}): "
            f"{_fmt(x, '.1f')}x (target >= {HF_RATIO:.0f}x)")  # fmt: skip
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _pct(run: dict | None, key: str = "hit_rate") -> str:
    return "n/a" if run is None else f"{100 * run[key]:.1f}%"
