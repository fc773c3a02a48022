"""Failed steps and aborts around host-tier transfers, on the scripted runner that models KV
content (each block holds the token ids written there, swap ops copy them).

After a step that raised with SwapIn / SwapOut ops in it, no radix node may claim a copy (device
or host) that the step may not have made (`check_tree_content` reads every claimed copy back),
both pools balance, and the requests of the failed step fail while every other request (one
whose history loaded in that step without a row in it, too) and every later identical request
gets the output of an unconstrained run.
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_host_tier_scheduler import check_pools, make_core

from radixrt.deltas import FinishReason
from radixrt.engine.core import EngineCore
from radixrt.plan import StepPlan, SwapIn, SwapOut
from radixrt.sampling import SamplingParams

SP = SamplingParams(max_tokens=3, ignore_eos=True)
HISTORY = list(range(500, 560))  # 15 blocks of 4


def has_swap_in(plan: StepPlan) -> bool:
    return any(isinstance(op, SwapIn) for op in plan.block_ops)


def has_swap_out(plan: StepPlan) -> bool:
    return any(isinstance(op, SwapOut) for op in plan.block_ops)


def fail_once(runner, when, *, ran: bool, at_result: bool = False) -> list[StepPlan]:
    """Make `runner.execute` raise once, on the first plan `when(plan)` picks: before it
    executed anything (`ran=False`), after executing all of it (`ran=True`), or (`at_result`)
    from its handle's result(). Returns a list that receives the failed plan."""
    execute = runner.execute
    failed: list[StepPlan] = []

    class Failing:
        def __init__(self, handle) -> None:
            self.handle = handle

        def result(self):
            raise RuntimeError("injected failure of the step's result")

    def wrapped(plan, *args, **kwargs):
        if failed or not when(plan):
            return execute(plan, *args, **kwargs)
        failed.append(plan)
        if at_result:
            return Failing(execute(plan, *args, **kwargs))
        if ran:
            execute(plan, *args, **kwargs)
        raise RuntimeError("injected step failure")

    runner.execute = wrapped
    return failed


def drain(core: EngineCore, out: dict, reasons: dict | None = None) -> None:
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
            if reasons is not None and d.finish_reason is not None:
                reasons[d.rid] = d.finish_reason
    core.check_integrity()


def check_tree_content(core: EngineCore, runner) -> None:
    """Every copy the tree claims holds its path's KV: for each node and tier, the block
    recorded for position p holds the path's tokens at positions floor(p / B) * B .. p."""
    cache, bs = core.cache, core.cache.block_size
    assert not core.scheduler.kv.pending_ops and not cache.host.pending_ops
    stack = [(child, []) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        first = node.start // bs
        for blocks, kv, tier in (
            (node.blocks, runner.kv, "device"),
            (node.host_blocks, runner.host_kv, "host"),
        ):
            for p in range(first * bs, node.end) if blocks else ():
                block = blocks[p // bs - first]
                got = kv.get(block, [None] * bs)[p % bs]
                assert got == path[p], f"{tier} block {block} of {node.key[:4]}.. at {p}: {got}"
        stack += [(child, path) for child in node.children.values()]


def history_on_host(core: EngineCore, runner) -> None:
    """HISTORY cached, then pushed to the host by other prompts."""
    core.add_request(HISTORY, SP, rid="warm")
    drain(core, {})
    for i in range(3):
        core.add_request([700 + 50 * i + j for j in range(40)], SP, rid=f"fill{i}")
        drain(core, {})
    m = core.cache.match(HISTORY)
    assert m.num_host_tokens == len(HISTORY) and not m.blocks
    check_tree_content(core, runner)


def reference(prompts: dict[str, list[int]], overlap: bool) -> dict[str, list[int]]:
    ref, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None)
    out: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        ref.add_request(prompt, SP, rid=rid)
        drain(ref, out)
    return out


def after_failure(core: EngineCore, runner, out: dict, reasons: dict, ran: bool) -> None:
    drain(core, out, reasons)
    check_pools(core)
    check_tree_content(core, runner)
    s = core.stats()
    assert s["failed_steps"] == 1
    if not ran:  # the counters leave out the failed plan's ops: what the runner executed
        executed = Counter(type(op).__name__ for op in runner.swaps)
        assert s["host_written_back_blocks"] == executed["SwapOut"]
        assert s["host_loaded_blocks"] == executed["SwapIn"]


@pytest.mark.parametrize("ran", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_loading_a_history(overlap, ran):
    """The step whose ops load V's history fails (V has the step's only row): V fails, and
    the tree keeps no device copy the loads were to make; the same prompt then runs right."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    history_on_host(core, runner)
    failed = fail_once(runner, has_swap_in, ran=ran)
    prompt = HISTORY + [9, 9]
    core.add_request(prompt, SP, rid="V")
    out, reasons = {}, {}
    after_failure(core, runner, out, reasons, ran)
    assert failed and reasons["V"] is FinishReason.ERROR
    core.add_request(prompt, SP, rid="again")
    drain(core, out)
    assert out["again"] == reference({"again": prompt}, overlap)["again"]
    check_pools(core)
    check_tree_content(core, runner)


@pytest.mark.parametrize("ran", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_with_a_deferred_load(overlap, ran):
    """V's history loads in a step whose only row is A's (V's first row waits for the next
    plan); that step fails: A fails, V still gets the unconstrained output, so does a later
    identical request."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    history_on_host(core, runner)
    a_prompt = [900 + i for i in range(10)]
    core.add_request(a_prompt, SamplingParams(max_tokens=8, ignore_eos=True), rid="A")
    core.step()
    failed = fail_once(runner, has_swap_in, ran=ran)
    prompt = HISTORY + [9, 9]
    core.add_request(prompt, SP, rid="V")
    out, reasons = {}, {}
    after_failure(core, runner, out, reasons, ran)
    assert [r.rid for r in failed[0].rows] == ["A"], "V's load was not deferred"
    assert core.stats()["host_deferred_loads"] >= 1
    assert reasons["A"] is FinishReason.ERROR and reasons["V"] is FinishReason.LENGTH
    want = reference({"V": prompt, "again": prompt}, overlap)
    assert out["V"] == want["V"]
    core.add_request(prompt, SP, rid="again")
    drain(core, out)
    assert out["again"] == want["again"]
    check_tree_content(core, runner)


@pytest.mark.parametrize("ran", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_writing_back(overlap, ran):
    """The step whose ops write HISTORY back (its device blocks go to a long prompt) fails:
    no host copy it was to make is believed, and HISTORY's next turn is still right."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    core.add_request(HISTORY, SP, rid="warm")
    drain(core, {})
    failed = fail_once(runner, has_swap_out, ran=ran)
    core.add_request([700 + j for j in range(120)], SP, rid="big")
    out, reasons = {}, {}
    after_failure(core, runner, out, reasons, ran)
    assert failed and reasons["big"] is FinishReason.ERROR
    prompt = HISTORY + [9, 9]
    core.add_request(prompt, SP, rid="again")
    drain(core, out)
    assert out["again"] == reference({"again": prompt}, overlap)["again"]
    check_pools(core)
    check_tree_content(core, runner)


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_result_of_a_loading_step(overlap):
    """The loads ran but the step's result raises (with overlap, after the next plan was
    made on top of it): V and A fail or finish, nothing claims a copy it lacks, and the
    history's next turn is right."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    history_on_host(core, runner)
    a_prompt = [900 + i for i in range(10)]
    core.add_request(a_prompt, SamplingParams(max_tokens=8, ignore_eos=True), rid="A")
    core.step()
    ran = True
    failed = fail_once(runner, has_swap_in, ran=ran, at_result=True)
    prompt = HISTORY + [9, 9]
    core.add_request(prompt, SP, rid="V")
    out, reasons = {}, {}
    after_failure(core, runner, out, reasons, ran)
    assert failed and reasons["A"] is FinishReason.ERROR
    want = reference({"V": prompt, "again": prompt}, overlap)
    if reasons["V"] is not FinishReason.ERROR:
        assert out["V"] == want["V"]
    core.add_request(prompt, SP, rid="again")
    drain(core, out)
    assert out["again"] == want["again"]
    check_tree_content(core, runner)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_of_a_deferred_load(overlap):
    """V's history loads in a step in which V has no row yet; V is aborted before its first
    row: nothing leaks, the loaded copy is valid, the same prompt reuses it."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    history_on_host(core, runner)
    core.add_request([900 + i for i in range(10)], SamplingParams(max_tokens=8), rid="A")
    core.step()
    prompt = HISTORY + [9, 9]
    core.add_request(prompt, SP, rid="V")
    loaded = core.stats()["host_loaded_blocks"]
    core.step()
    assert core.stats()["host_deferred_loads"] == 1
    assert core.stats()["host_loaded_blocks"] > loaded
    assert core.request("V").num_output == 0
    core.abort("V")
    out = {}
    drain(core, out)
    check_pools(core)
    check_tree_content(core, runner)
    swaps = core.stats()["host_loaded_blocks"]
    core.add_request(prompt, SP, rid="again")
    drain(core, out)
    assert core.stats()["host_loaded_blocks"] == swaps, "the loaded copy was not reused"
    assert out["again"] == reference({"again": prompt}, overlap)["again"]
    check_tree_content(core, runner)


# ---- the pieces ----


def test_unmade_blocks_follow_later_reads():
    from radixrt.cache.tiers import unmade_blocks
    from radixrt.plan import CopyBlock

    failed = [SwapOut(1, 10), SwapIn(11, 2), CopyBlock(2, 3, 2)]
    later = [[SwapIn(10, 4), SwapIn(12, 5)], [SwapOut(4, 13), CopyBlock(4, 6, 1), SwapOut(7, 14)]]
    assert unmade_blocks(failed, later) == ({2, 3, 4, 6}, {10, 13})
    assert unmade_blocks([], later) == (set(), set())


def test_discard_copies_on_the_tree():
    """Device blocks that a failed load was to fill leave the device (with the device nodes
    below), host blocks a failed write-back was to fill are dropped, a node with no copy left
    leaves the tree with its subtree."""
    from test_host_tier_scheduler import put, tree

    cache, alloc = tree(num_blocks=12, host_blocks=12)
    put(cache, list(range(8)))  # [0, 8): 2 blocks
    put(cache, list(range(12)))  # + [8, 12)
    put(cache, list(range(8)) + [50, 51, 52, 53])  # + a sibling [8, 12)
    cache.evict(12)
    assert len(cache.take_swap_ops()) == 4 and cache.cached_blocks == 0
    m = cache.match(list(range(12)))
    cache.lock(m.handle)
    cache.load(m.handle)
    loads = cache.take_swap_ops()
    cache.unlock(m.handle)
    cache.check_integrity()
    top = cache.root.children[0]
    child = top.children[8]
    sibling = top.children[50]
    stale = cache.stale_nodes({top.blocks[0]}, {sibling.host_blocks[0]})
    assert stale == [sibling, child, top] or stale == [child, sibling, top]
    cache.discard_copies({top.blocks[0]}, {sibling.host_blocks[0]})
    cache.check_integrity()
    assert not top.blocks and not child.blocks and top.host_blocks and child.host_blocks
    assert sibling.parent is None and 50 not in top.children
    assert alloc.num_free == 12 and cache.host_cached_blocks == 3
    assert len(loads) == 3
