"""Differential soak: one seeded mixed workload (shared prefixes, long and short prompts;
greedy rows interleaved with streamed, grammar-constrained, n > 1, beam-search and sampled
rows; aborts and client disconnects) against a plain `radixrt serve` and against servers with
features on under KV pressure (`benchmarks.differential.CONFIGS`: host tier, ngram
speculation, both): every greedy answer the same, and the KV accounting balanced once idle.

Real server processes: the workload goes through the front (streams, /abort, dropped
connections) as clients' requests do. The servers run on the CPU, so without overlap
scheduling (the in-process tests cover overlap). `benchmarks/soak_differential.py` runs the
same check longer.
"""

from __future__ import annotations

import pytest
from server_utils import serving

from benchmarks.differential import (
    CONFIGS,
    REFERENCE_ARGS,
    check_balanced,
    compare,
    make_workload,
    run_workload,
)

SEED = 7
NUM_REQUESTS = 150
CONCURRENCY = 12


@pytest.fixture(scope="module")
def workload():
    return make_workload(SEED, NUM_REQUESTS)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, workload):
    with serving(tiny_model_dir, *REFERENCE_ARGS) as srv:
        answers = run_workload(srv.url, workload, CONCURRENCY, fates=False)
        check_balanced(srv.url)
    return answers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_answers_match_the_plain_server(tiny_model_dir, workload, reference, name):
    with serving(tiny_model_dir, *CONFIGS[name]) as srv:
        answers = run_workload(srv.url, workload, CONCURRENCY)
        snap = check_balanced(srv.url)
    result = compare(workload, reference, answers)
    assert not result.mismatches, "\n".join(result.mismatches[:10])
    assert result.num_compared >= NUM_REQUESTS // 2
    # the workload exercised what it is for
    assert snap["preemptions"] > 0 and snap["forks"] > 0 and snap["beam_steps"] > 0
    if "--host-kv-gb" in CONFIGS[name]:
        assert snap["host_loaded_blocks"] > 0 and snap["host_written_back_blocks"] > 0
    if "--speculative-method" in CONFIGS[name]:
        assert snap["spec_accepted_tokens"] > 0
    kinds = {job.kind for job in workload}
    fates = {job.fate for job in workload}
    assert {"grammar", "beam", "greedy_n", "sampled_n"} <= kinds
    assert {"abort", "disconnect"} <= fates
