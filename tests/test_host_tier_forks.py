"""The host KV tier with forks (n > 1) and beam searches on the plain-Python scheduler, with a
scripted runner that models KV content: a copy-on-write op planned for a fork or a beam whose
target block is freed before the plan goes out (the group preempted or aborted) must not run,
because the plan runs its swap-ins first and that block may be one of their targets."""

from __future__ import annotations

import random

import pytest
from test_fork_beam_scheduler import beam_tops
from test_host_tier_scheduler import drain, make_core

from radixrt.plan import CopyBlock, SwapIn
from radixrt.sampling import BeamSearchParams, SamplingParams


def ctx(rid: str, context):
    """Beams ("b..." searches) get top log-probs, everything else one context-hash token."""
    if rid.startswith("b") and "#" in rid:
        return beam_tops(context)
    return 10 + hash(tuple(context)) % 3000


def greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """What a request of `prompt` must produce: every token read back from its own KV."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(ctx("g", seq))
    return seq[len(prompt) :]


def content_core(**kw):
    core, runner = make_core(**kw)
    runner.context_fn = ctx
    return core, runner


def test_load_into_the_target_of_an_aborted_beams_copy():
    """A beam step queues copies for the next plan; the search is aborted before it goes
    out (without overlap: with it, the next plan is made in the same `step()`), and that plan
    loads a history from the host into the blocks the copies targeted."""
    core, runner = content_core(overlap=False, num_kv_blocks=24, host_blocks=64)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    history = list(range(500, 530))
    core.add_request(history, sp, rid="h")
    drain(core, {})
    core.cache.evict(core.allocator.num_blocks)  # the history to the host
    assert core.cache.match(history).num_host_tokens == len(history)
    core.add_beam_search([7, 8, 9, 10, 11, 12], BeamSearchParams(beam_width=4, max_tokens=9), "b")
    while not any(isinstance(op, CopyBlock) for op in core.scheduler._pending_ops):
        core.step()
    core.abort("b")
    core.add_request([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), rid="other")
    core.add_request(history + [42], sp, rid="reader")
    out: dict[str, list[int]] = {}
    drain(core, out)
    assert any(isinstance(op, SwapIn) for op in runner.swaps)
    assert out["reader"] == greedy(history + [42], 3)
    assert out["other"] == greedy([1, 2], 2)


def mixed(core, seed: int, num_requests: int = 40) -> tuple[dict, dict]:
    """Greedy, n > 1 and beam-search requests over a few shared prefixes, added while
    earlier ones run; integrity after every step. Returns (outputs, greedy prompts)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(100, 900) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    want: dict[str, list[int]] = {}
    out: dict[str, list[int]] = {}

    def step():
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
        core.check_integrity()

    for i in range(num_requests):
        prompt = rng.choice(bases) + [rng.randrange(100, 900) for _ in range(rng.randrange(1, 10))]
        kind, m = rng.random(), rng.randrange(1, 8)
        if kind < 0.4:
            core.add_request(prompt, SamplingParams(max_tokens=m, ignore_eos=True), rid=f"r{i}")
            want[f"r{i}"] = greedy(prompt, m)
        elif kind < 0.7:
            n = rng.choice([2, 4])
            sp = SamplingParams(max_tokens=m, ignore_eos=True, n=n, temperature=1.0, seed=i)
            core.add_request(prompt, sp, rid=f"r{i}")
        else:
            bp = BeamSearchParams(beam_width=rng.choice([2, 3]), max_tokens=rng.randrange(2, 7))
            core.add_beam_search(prompt, bp, rid=f"br{i}")
        for _ in range(rng.randrange(0, 4)):
            if core.has_work:
                step()
    while core.has_work:
        step()
    return out, want


# (seed, device blocks, host blocks): runs in which a group's copies lost their targets before
# their plan went out and host loads reused those blocks
CASES = [(2, 16, 12), (23, 20, 64), (24, 16, 12)]


@pytest.mark.parametrize("seed,num_kv_blocks,host_blocks", CASES)
def test_mixed_forks_beams_and_greedy_under_pressure(seed, num_kv_blocks, host_blocks):
    core, runner = content_core(
        overlap=True,
        num_kv_blocks=num_kv_blocks,
        host_blocks=host_blocks,
        max_running_requests=8,
        max_num_batched_tokens=32,
    )
    out, want = mixed(core, seed)
    assert {rid: out.get(rid) for rid in want} == want
    s = core.stats()
    assert s["preemptions"] > 0 and s["host_loaded_blocks"] > 0 and s["fork_copied_blocks"] > 0
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks
