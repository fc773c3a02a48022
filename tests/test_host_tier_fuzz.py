"""Randomised host-tier workloads on the content-modelling scripted runner: rounds of chats that
grow or branch their histories, on small device and host pools with random block and token
budgets, random aborts, and (odd seeds) one injected step failure (before, after or at the
result of a plan with swap ops). After every round: integrity of both pools, every copy the tree
claims holds its path's KV, and every request that neither failed nor was aborted has the
output of an unconstrained run."""

from __future__ import annotations

import random

import pytest
from test_host_tier_failures import check_tree_content, fail_once
from test_host_tier_scheduler import check_pools, make_core

from radixrt.deltas import FinishReason
from radixrt.plan import SwapIn, SwapOut
from radixrt.sampling import SamplingParams


def run_rounds(seed: int, overlap: bool) -> dict:
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    core, runner = make_core(
        overlap=overlap,
        num_kv_blocks=rng.randint(30, 60) * 4 // bs,
        host_blocks=rng.randint(8, 200),
        block_size=bs,
        max_num_batched_tokens=rng.choice([16, 64, 256]),
    )
    ref, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None, block_size=bs)
    if seed % 2:
        kind = rng.choice([SwapIn, SwapOut])
        fail_once(
            runner,
            lambda p: any(isinstance(op, kind) for op in p.block_ops) and rng.random() < 0.3,
            ran=rng.random() < 0.5,
            at_result=rng.random() < 0.3,
        )
    hist = {c: [1000 + 17 * c + i for i in range(rng.randint(5, 40))] for c in range(8)}
    for rnd in range(6):
        out: dict[str, list[int]] = {}
        want: dict[str, list[int]] = {}
        skip: set[str] = set()  # aborted or failed
        rids = {}
        for c in rng.sample(range(8), rng.randint(1, 6)):
            if rng.random() < 0.3:  # a branch: go on from an earlier point of the history
                hist[c] = hist[c][: rng.randint(1, len(hist[c]))]
            hist[c] = hist[c] + [2000 + rng.randint(0, 50) for _ in range(rng.randint(1, 12))]
            rids[c] = rid = f"c{c}r{rnd}"
            sp = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True)
            core.add_request(hist[c], sp, rid=rid)
            ref.add_request(hist[c], sp, rid=rid)
        while core.has_work:
            for d in core.step():
                out.setdefault(d.rid, []).extend(d.new_token_ids)
                if d.finish_reason is FinishReason.ERROR:
                    skip.add(d.rid)
            if rng.random() < 0.05 and core.scheduler.requests:
                rid = rng.choice(sorted(core.scheduler.requests))
                skip.add(rid)
                core.abort(rid)
        core.check_integrity()
        check_pools(core)
        check_tree_content(core, runner)
        while ref.has_work:
            for d in ref.step():
                want.setdefault(d.rid, []).extend(d.new_token_ids)
        for c, rid in rids.items():
            if rid not in skip:
                assert out.get(rid, []) == want[rid], f"seed {seed}: {rid}"
            hist[c] = hist[c] + want[rid]
    return core.stats()


@pytest.mark.parametrize("overlap", [False, True])
def test_random_workloads_with_failures_and_aborts(overlap):
    totals = {"host_hit_tokens": 0, "failed_steps": 0, "preemptions": 0}
    for seed in range(16):
        s = run_rounds(seed, overlap)
        for k in totals:
            totals[k] += s[k]
    assert all(v > 0 for v in totals.values()), totals  # the seeds reach every path
