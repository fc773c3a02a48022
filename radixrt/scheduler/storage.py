"""The storage tier's scheduler half: prefetch before admission.

A waiting request first seen by admission whose prompt has a full page past its L1/L2 match
asks storage for the pages from there on (`StorageRadixCache.begin_fetch`) and is not admitted
while the fetch runs, up to the tier's `prefetch_timeout_s`; then it is admitted and computes
what is not cached by then. A fetch that ends late still puts its pages in the tree for later
requests. The step loop never waits: the runner reads pages in the background and the engine
hands finished fetches to the cache between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.request import Request


@dataclass
class _Wait:
    ticket: int
    since: float  # time.monotonic() when the fetch began


class StorageFeature(SchedulerFeature):
    def __init__(self, cache: StorageRadixCache) -> None:
        self.cache = cache
        self.timeout_s = cache.storage.prefetch_timeout_s
        self._waits: dict[Request, _Wait] = {}
        self._asked: set[Request] = set()  # requests that had their one chance to fetch

    def admissible(self, req: Request) -> bool:
        wait = self._waits.get(req)
        if wait is not None:
            waited = time.monotonic() - wait.since
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
        ticket = self.cache.begin_fetch(tokens, req.cache_namespace, m.num_cached_tokens)
        if ticket is None:
            return True
        self.cache.storage.stats.prefetch_waits += 1
        self._waits[req] = _Wait(ticket, time.monotonic())
        return False

    def on_finish(self, req: Request) -> None:
        self._waits.pop(req, None)
        self._asked.discard(req)

    def check_integrity(self) -> None:
        assert self._waits.keys() <= self._asked
