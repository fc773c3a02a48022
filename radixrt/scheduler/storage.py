"""The storage tier's scheduler half: load or recompute, and prefetch before admission.

A waiting request first seen by admission whose prompt has a full page past its L1/L2 match
asks the tier's cost model (`radixrt.cache.storage_cost`) whether loading those pages beats
computing them. If so, it asks storage for them (`StorageRadixCache.begin_fetch`) and is not
admitted while the fetch runs, up to the tier's `prefetch_timeout_s`; then it is admitted and
computes what is not cached by then. Otherwise it is admitted at once (a probe fetch may run
beside it to measure storage). A fetch that ends late still puts its pages in the tree for
later requests. The step loop never waits: the runner reads pages in the background and the
engine hands finished fetches to the cache between steps. `on_step` feeds the cost model the
prefill throughput of the steps the scheduler timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage_cost import Choice
from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.request import Request


@dataclass
class _Wait:
    ticket: int
    since: float  # the clock when the fetch began


class StorageFeature(SchedulerFeature):
    def __init__(
        self, cache: StorageRadixCache, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`clock`: seconds, for how long requests wait for fetches."""
        self.cache = cache
        self.clock = clock
        self.timeout_s = cache.storage.prefetch_timeout_s
        self._waits: dict[Request, _Wait] = {}
        self._asked: set[Request] = set()  # requests that had their one chance to fetch

    def admissible(self, req: Request) -> bool:
        wait = self._waits.get(req)
        if wait is not None:
            waited = self.clock() - wait.since
            if self.cache.fetching(wait.ticket) and waited < self.timeout_s:
                return False
            del self._waits[req]
            stats = self.cache.storage.stats
            stats.prefetch_wait_s += waited
            stats.prefetch_timeouts += self.cache.fetching(wait.ticket)
            return True
        if req in self._asked:
            return True
        self._asked.add(req)
        # The last prompt token is always computed (its logits are sampled).
        tokens = req.seq_token_ids[: len(req.seq_token_ids) - 1]
        m = self.cache.match(tokens, req.cache_namespace)
        num_pages = self.cache.pages_to_fetch(len(tokens), m.num_cached_tokens)
        if num_pages <= 0:
            return True
        tier = self.cache.storage
        choice = tier.cost.decide(num_pages, num_pages * self.cache.block_size)
        if choice is Choice.LOAD:
            tier.stats.loads_chosen += 1
        else:
            tier.stats.recomputes_chosen += 1
        if choice is Choice.RECOMPUTE:
            return True
        ticket = self.cache.begin_fetch(tokens, req.cache_namespace, m.num_cached_tokens)
        if ticket is None:
            return True
        if choice is Choice.PROBE:  # nobody waits: it measures, and its pages serve later
            tier.stats.probe_fetches += 1
            return True
        tier.stats.prefetch_waits += 1
        self._waits[req] = _Wait(ticket, self.clock())
        return False

    def on_step(self, num_prompt_tokens: int, seconds: float) -> None:
        """A step that computed `num_prompt_tokens` prompt tokens took `seconds` (the
        scheduler's clock, from launch or the previous result to its result)."""
        self.cache.storage.cost.observe_prefill(num_prompt_tokens, seconds)

    def on_finish(self, req: Request) -> None:
        self._waits.pop(req, None)
        self._asked.discard(req)

    def check_integrity(self) -> None:
        assert self._waits.keys() <= self._asked
