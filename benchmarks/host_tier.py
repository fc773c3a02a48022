"""The host KV tier's table: each radix-host+<policy> run against radix+<policy> on the same
workload."""

from __future__ import annotations

from collections.abc import Sequence


def format_host_table(runs: Sequence[dict]) -> str:
    """Markdown table of every workload with a radix-host run ('' when none): hit rate (of
    the best possible), host hits, prompt tokens computed, TTFT p50 and request throughput,
    each also as a ratio to the radix run of the workload with the same policy, and the
    transfers."""
    host = [r for r in runs if r["cache"] == "radix-host"]
    if not host:
        return ""
    base = {(r["workload"], r["policy"]): r for r in runs if r["cache"] == "radix"}
    lines = [
        "| workload | config | hit % (best) | host hits | prompt computed (x radix) "
        "| TTFT p50 ms (x radix) | req/s (x radix) | loaded / written blocks | swap GB, s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in host:
        b = base.get((r["workload"], r["policy"]))
        ratio = lambda key, sub=None, r=r, b=b: _ratio(r, b, key, sub)  # noqa: E731
        base_hit = f", no tier {100 * b['hit_rate']:.1f}" if b else ""
        lines.append(
            f"| {r['workload']} | {r['config']} | {100 * r['hit_rate']:.1f} "
            f"({100 * r['best_hit_rate']:.1f}{base_hit}) | {r['host_hit_tokens']} "
            f"| {r['prompt_tokens_computed']}{ratio('prompt_tokens_computed')} "
            f"| {r['ttft_ms']['p50']:.0f}{ratio('ttft_ms', 'p50')} "
            f"| {r['request_throughput']:.2f}{ratio('request_throughput')} "
            f"| {r['host_loaded_blocks']} / {r['host_written_back_blocks']} "
            f"| {(r['swap_bytes'] or 0) / 1e9:.2f}, {r['swap_seconds'] or 0:.2f} |"
        )
    return "\n".join(lines)


def _ratio(r: dict, b: dict | None, key: str, sub: str | None) -> str:
    """' (<r / b>x)' of a field (sub-field), '' without a base run."""
    if b is None:
        return ""
    x, y = (r[key], b[key]) if sub is None else (r[key][sub], b[key][sub])
    return f" ({x / y:.2f}x)" if x is not None and y else ""
