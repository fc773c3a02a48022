"""Differential LoRA mix: one seeded mixed workload spread over two PEFT adapters and the base
model (`benchmarks.differential`, `loras=`), a third of its prompts repeated under another
adapter, on a server that batches adapters together under KV pressure with the radix cache and
the host tier; every greedy answer equals that request's run alone on a server without a prefix
cache. A cache entry reused across adapters, or a batch applying a row's adapter to another,
changes an answer. `benchmarks/soak_differential.py --configs lora` runs it longer."""

from __future__ import annotations

import pytest
from server_utils import serving

from benchmarks.differential import (
    LORA_ADAPTERS,
    LORA_REFERENCE_ARGS,
    check_balanced,
    compare,
    lora_args,
    lora_config,
    make_lora_adapters,
    make_workload,
    run_workload,
)

SEED = 3
NUM_REQUESTS = 48
CONCURRENCY = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("peft")
    return make_lora_adapters(tiny_model_dir, str(tmp_path_factory.mktemp("lora-mix")))


@pytest.fixture(scope="module")
def workload():
    return make_workload(SEED, NUM_REQUESTS, loras=LORA_ADAPTERS)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters, workload):
    with serving(tiny_model_dir, *LORA_REFERENCE_ARGS, *lora_args(adapters)) as srv:
        answers = run_workload(srv.url, workload, 1, fates=False)  # one request at a time
        check_balanced(srv.url)
    return answers


def test_workload_shares_prompts_across_adapters(workload, reference):
    assert {job.body.get("lora_path") for job in workload} == {None, *LORA_ADAPTERS}
    by_prompt: dict[tuple, list] = {}
    for job in workload:
        if job.kind in ("greedy", "stream", "greedy_n"):  # plain greedy answers
            by_prompt.setdefault(tuple(job.body["input_ids"]), []).append(job)
    shared = differ = 0
    for jobs in by_prompt.values():
        for i, one in enumerate(jobs):
            for other in jobs[i + 1 :]:
                if one.body.get("lora_path") == other.body.get("lora_path"):
                    continue
                shared += 1
                x, y = reference[one.rid].outputs[0], reference[other.rid].outputs[0]
                differ += x[: len(y)] != y[: len(x)]
    # a prompt under two adapters, answered differently: a cache entry reused across them shows
    assert shared >= 3 and differ >= 2, (shared, differ)


def test_lora_mix_greedy_answers_match_each_request_alone(
    tiny_model_dir, adapters, workload, reference
):
    with serving(tiny_model_dir, *lora_config(adapters)) as srv:
        answers = run_workload(srv.url, workload, CONCURRENCY)
        snap = check_balanced(srv.url)
    result = compare(workload, reference, answers)
    assert not result.mismatches, "\n".join(result.mismatches[:10])
    assert result.num_compared >= NUM_REQUESTS // 2
    assert snap["preemptions"] > 0 and snap["host_loaded_blocks"] > 0
