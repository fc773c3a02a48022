"""A differential workload (`benchmarks.differential`) on an in-process `EngineCore`: the same
jobs, the same answers to compare, but deterministic (arrivals and aborts at seeded steps, no
sockets) and with overlap scheduling available on the CPU. A disconnect is an abort here (what
the server turns it into). Used by tests/test_differential_soak.py."""

from __future__ import annotations

import random

from benchmarks.differential import Answer, Job
from radixrt.deltas import FinishReason
from radixrt.sampling import BeamSearchParams, SamplingParams

STEPS_PER_SECOND = 50  # a job's delay_s -> steps before its abort
MAX_STEPS = 200_000

# Engine options (CPU, float32): the reference, and rows like `differential.CONFIGS`.
REFERENCE_OPTIONS = {"num_kv_blocks": 2048, "block_size": 4}
PRESSURE = {"num_kv_blocks": 48, "block_size": 4, "max_running_requests": 8}
HOST = {"num_host_kv_blocks": 96}
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3}
CONFIGS: dict[str, dict] = {
    "host": {**PRESSURE, **HOST},
    "host+overlap": {**PRESSURE, **HOST, "overlap_schedule": True},
    "host+ngram+overlap": {**PRESSURE, **HOST, **NGRAM, "overlap_schedule": True},
}


def run_in_process(core, jobs: list[Job], seed: int, concurrency: int, fates: bool = True):
    """rid -> Answer. Jobs arrive in order, up to `concurrency` at once, a seeded 0-3 per
    step; a job with fate abort or disconnect is aborted a seeded number of steps after it
    arrived. Integrity is checked after every step."""
    rng = random.Random(seed)
    pending = list(reversed(jobs))
    outputs: dict[str, dict[int, list[int]]] = {job.rid: {} for job in jobs}
    reasons: dict[str, list[FinishReason]] = {job.rid: [] for job in jobs}
    open_jobs: dict[str, int] = {}  # rid -> step at which to abort it (-1: never)
    by_rid = {job.rid: job for job in jobs}
    step = 0
    while pending or core.has_work:
        for _ in range(rng.randint(0, 3)):
            if pending and len(open_jobs) < concurrency:
                job = pending.pop()
                _add(core, job)
                aborts = fates and job.fate != "complete"
                open_jobs[job.rid] = step + int(job.delay_s * STEPS_PER_SECOND) if aborts else -1
        deltas = [core.abort(rid) for rid, when in open_jobs.items() if when == step]
        for d in [d for d in deltas if d is not None] + core.step():
            rid = d.parent_rid or d.rid
            if d.beams is not None:
                outputs[rid] = {k: list(b.output_token_ids) for k, b in enumerate(d.beams)}
            else:
                outputs[rid].setdefault(d.index, []).extend(d.new_token_ids)
            if d.finished:
                reasons[rid].append(d.finish_reason)
        core.check_integrity()
        for rid in list(open_jobs):
            if len(reasons[rid]) == _num_finishes(by_rid[rid]):
                del open_jobs[rid]
        step += 1
        assert step < MAX_STEPS, f"no progress: {len(pending)} jobs wait, {open_jobs} open"
    return {
        rid: Answer(
            200,
            [outputs[rid][k] for k in sorted(outputs[rid])],
            FinishReason.ABORT not in reasons[rid] and bool(outputs[rid]),
        )
        for rid in outputs
    }


def _num_finishes(job: Job) -> int:
    """Deltas with a finish reason the job gets (one per n > 1 child)."""
    return job.body["sampling_params"].get("n", 1)


def _add(core, job: Job) -> None:
    sp = dict(job.body["sampling_params"])
    prompt = job.body["input_ids"]
    max_tokens = sp.pop("max_new_tokens")
    width = sp.pop("beam_width", None)
    if width is not None:
        params = BeamSearchParams(width, max_tokens, ignore_eos=sp["ignore_eos"])
        core.add_beam_search(prompt, params, rid=job.rid)
        return
    core.add_request(prompt, SamplingParams(max_tokens=max_tokens, **sp), rid=job.rid)
