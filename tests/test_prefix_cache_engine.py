"""Prefix caching inside the engine: identical greedy outputs under radix, blockhash and
none; token-exact reuse for radix, whole blocks for blockhash; eviction under memory
pressure; aging bounds how long lpm can starve a request."""

from __future__ import annotations

import random

import pytest

from radixrt import SamplingParams

B = 4  # block size: small, so matches end mid-block often


def multi_turn(engine, num_users=3, turns=4, seed=0):
    """Users interleaved turn by turn; each prompt = history + new user tokens.
    Returns [(prompt_ids, output)] in submission order."""
    rng = random.Random(seed)
    history = [
        [rng.randrange(10, 2000) for _ in range(rng.randrange(5, 30))] for _ in range(num_users)
    ]
    log = []
    for _ in range(turns):
        prompts = []
        for u in range(num_users):
            history[u] = history[u] + [rng.randrange(10, 2000) for _ in range(rng.randrange(1, 23))]
            prompts.append(history[u])
        params = [
            SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0, ignore_eos=True)
            for _ in prompts
        ]
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        for u, o in enumerate(outs):
            log.append((prompts[u], o))
            history[u] = prompts[u] + o.token_ids
        engine.check_integrity()
    return log


@pytest.fixture(scope="module")
def reference_turns(tiny_model_dir):
    from radixrt import Engine

    return multi_turn(Engine(tiny_model_dir, device="cpu", prefix_cache="none", block_size=B))


@pytest.mark.parametrize("cache", ["radix", "blockhash"])
def test_multi_turn_same_outputs_and_exact_reuse(make_engine, reference_turns, cache):
    engine = make_engine(prefix_cache=cache, block_size=B)
    log = multi_turn(engine)
    assert [o.token_ids for _, o in log] == [o.token_ids for _, o in reference_turns]
    num_users = 3
    for i, (prompt, out) in enumerate(log):
        if i < num_users:
            assert out.num_cached_tokens == 0
            continue
        prev_prompt, prev_out = log[i - num_users]
        # Cached: previous prompt + its output, less the last output token (never run),
        # capped at this prompt less its last token (always recomputed).
        exact = min(len(prev_prompt) + len(prev_out.token_ids) - 1, len(prompt) - 1)
        expected = exact if cache == "radix" else exact // B * B
        assert out.num_cached_tokens == expected, (i, out.num_cached_tokens, expected)
    if cache == "radix":
        # A turn's match ends where the previous turn's leaf ends, usually mid-block: the
        # request writes on in that block (no other holder) instead of copying it.
        assert engine.stats()["inplace_appends"] > 0


def test_shared_prefix_token_exact(make_engine):
    rng = random.Random(1)
    prefix = [rng.randrange(10, 2000) for _ in range(37)]  # not a multiple of B
    prompts = [prefix + [rng.randrange(10, 2000) for _ in range(5 + i)] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for cache in ("none", "radix", "blockhash"):
        engine = make_engine(prefix_cache=cache, block_size=B)
        first = engine.generate(prompt_token_ids=prompts[:1], sampling_params=params)
        rest = engine.generate(prompt_token_ids=prompts[1:], sampling_params=params)
        outs[cache] = [o.token_ids for o in first + rest]
        cached = [o.num_cached_tokens for o in rest]
        if cache == "radix":
            assert cached == [37] * 5
            assert engine.stats()["cow_copies"] >= 5  # 37 % 4 != 0: partial block copied
        elif cache == "blockhash":
            assert cached == [36] * 5
        else:
            assert cached == [0] * 5
    assert outs["radix"] == outs["none"] == outs["blockhash"]


@pytest.mark.parametrize("cache", ["radix", "blockhash"])
@pytest.mark.parametrize("overlap", [False, True])
def test_memory_pressure_evicts_and_keeps_outputs(make_engine, reference_turns, cache, overlap):
    # 40 blocks x 4 tokens: far below the workload's history, so the cache must evict.
    engine = make_engine(
        prefix_cache=cache, block_size=B, num_kv_blocks=40, overlap_schedule=overlap
    )
    log = multi_turn(engine)
    assert [o.token_ids for _, o in log] == [o.token_ids for _, o in reference_turns]
    assert engine.stats()["evicted_blocks"] > 0


def test_aging_bounds_lpm_starvation(make_engine):
    """A request that matches nothing, behind a steady stream of requests that match a
    long cached prefix: pure lpm starves it; with aging it is never overtaken by a request
    that arrived more than max_prompt_len / aging_tokens_per_step steps after it."""
    rng = random.Random(2)
    hot = [rng.randrange(10, 2000) for _ in range(120)]
    cold = [rng.randrange(10, 2000) for _ in range(20)]
    aging = 8.0
    bound = (len(hot) + 1) / aging  # steps

    def run(aging: float, steps: int = 80) -> tuple[bool, list[int]]:
        """Returns (cold finished, arrival steps of the hot requests that finished first)."""
        engine = make_engine(
            prefix_cache="radix", policy="lpm", max_running_requests=1, aging_tokens_per_step=aging
        )
        engine.generate(prompt_token_ids=[hot], sampling_params=SamplingParams(max_tokens=1))
        p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        cold_rid = engine.add_request(cold, p)
        arrival = {}
        overtook = []
        for step in range(steps):
            arrival[engine.add_request(hot + [rng.randrange(10, 2000)], p)] = step
            for d, _ in engine.step():
                if not d.finished:
                    continue
                if d.rid == cold_rid:
                    for rid in list(engine.scheduler.requests):
                        engine.abort(rid)
                    return True, overtook
                overtook.append(arrival[d.rid])
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        return False, overtook

    finished, _ = run(aging=0.0)
    assert not finished  # pure lpm: the stream starves it for the whole run
    finished, overtook = run(aging=aging)
    assert finished and overtook, overtook
    assert max(overtook) <= bound + 1, (max(overtook), bound)


@pytest.mark.parametrize("policy", ["fcfs", "dfs-weight"])
def test_policies_same_outputs(make_engine, reference_turns, policy):
    engine = make_engine(prefix_cache="radix", block_size=B, policy=policy, max_running_requests=2)
    log = multi_turn(engine)
    assert [o.token_ids for _, o in log] == [o.token_ids for _, o in reference_turns]
    assert engine.stats()["cache_hit_rate"] > 0.5
