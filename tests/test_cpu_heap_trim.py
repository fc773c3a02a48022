"""A CPU engine keeps freed activation memory between steps (radixrt.executor.cpu_malloc) but
at most KEEP_FREED_BYTES of it: a freed peak of the heap (a request of a new shape) does not
stay in the process's RSS for good (benchmarks/fuzz_campaign.py grew the scheduler by ~120 MiB
per 2,500 schema-fuzz requests while it did)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PEAK_MB = 256  # freed memory the heap must give back
MAX_KEPT_MB = 64  # what may stay of it after the engine's steps
DECODE_STEPS = 8  # steps after the peak was freed

# a fresh process: the heap's state and RSS are the process's, and a test runner's are not ours
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from radixrt import Engine, SamplingParams

    def rss_mb():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    model, peak_mb, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = Engine(model, device="cpu", dtype="float32")
    engine.generate(["warm up"], SamplingParams(max_tokens=2))
    trim = engine.core.runner.heap_trim
    base, trims = rss_mb(), trim.num_trims
    peak = torch.ones(peak_mb << 18)  # float32: peak_mb MiB, from the heap (below mmap's threshold)
    after_peak = torch.ones(16)  # allocated after it: freeing the peak may leave a hole
    del peak
    freed = rss_mb()
    out = engine.generate(["a"], SamplingParams(max_tokens=steps, ignore_eos=True))
    assert len(out[0].token_ids) == steps, len(out[0].token_ids)
    engine.check_integrity()
    trims = trim.num_trims - trims
    print(json.dumps({"base": base, "freed": freed, "after": rss_mb(), "trims": trims}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_cpu_engine_gives_a_freed_heap_peak_back(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model_dir, str(PEAK_MB), str(DECODE_STEPS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    # the engine keeps freed memory (no page faults per step): the peak is still resident
    assert rss["freed"] - rss["base"] > PEAK_MB * 0.8, rss
    # ... until its steps give the free pages back
    assert rss["after"] - rss["base"] < MAX_KEPT_MB, rss
    # once: decode steps' own activations stay in the heap (no page faults per step)
    assert rss["trims"] == 1, rss
