"""The front's record of finished requests that may hold their context (`cache_ttl_s`), by
the id their client knows, so that POST /release_cache_holds and GET /cache_pressure speak
in those ids.

A client knows a request by `meta_info["id"]` of /generate: its own `rid` when it sent one,
else the front's id of the scheduler request. The scheduler keeps a hold per request it ran
(an n > 1 request: per child), so one client id may stand for several scheduler ids (its
children, its prompts, earlier requests that reused the rid). Every record belongs to the
tenant whose key made the request: a lookup under another tenant finds nothing, exactly as
for an id never seen.

A record lives until its hold has surely ended: its time-to-live from when the front saw the
request finish (the engine's hold started before that and is capped at most as long), its
release, or a read of the engine's holds that no longer lists it (`keep_only`). Whether the
hold was taken at all (the share bound may refuse it) only the scheduler knows: a record is
the front's bound on what may hold, never a claim that it does.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Owner = tuple[str | None, str]  # (tenant, client id); tenant None: the server has no tenants


@dataclass
class HeldRequests:
    clock: Callable[[], float] = time.monotonic
    by_owner: dict[Owner, set[str]] = field(default_factory=dict)  # -> scheduler rids
    owner: dict[str, Owner] = field(default_factory=dict)  # scheduler rid -> its owner
    _expiry: list[tuple[float, str]] = field(default_factory=list)  # (clock time, rid) heap
    _expires: dict[str, float] = field(default_factory=dict)  # scheduler rid -> clock time

    def __len__(self) -> int:
        return len(self.owner)

    def add(self, tenant: str | None, client_id: str, rid: str, ttl_s: float) -> None:
        """Scheduler request `rid`, known to its client (of `tenant`) as `client_id`, finished
        with a hold of `ttl_s` seconds at most."""
        self._expire()
        self.forget([rid])
        key = (tenant, client_id)
        self.by_owner.setdefault(key, set()).add(rid)
        self.owner[rid] = key
        expires = self.clock() + ttl_s
        self._expires[rid] = expires
        heapq.heappush(self._expiry, (expires, rid))

    def rids(self, tenant: str | None, client_ids: Iterable[str]) -> list[str]:
        """The scheduler ids of `tenant`'s requests known as `client_ids` that may hold."""
        self._expire()
        found: dict[str, None] = {}
        for client_id in client_ids:
            found.update(dict.fromkeys(sorted(self.by_owner.get((tenant, client_id), ()))))
        return list(found)

    def client_ids(self, tenant: str | None, held: Iterable[str]) -> list[str]:
        """The client ids of `tenant`'s requests among the scheduler ids `held` (sorted)."""
        owners = (self.owner.get(rid) for rid in held)
        return sorted({o[1] for o in owners if o is not None and o[0] == tenant})

    def forget(self, rids: Iterable[str]) -> None:
        """Drop the records of scheduler requests `rids` (their holds ended)."""
        for rid in rids:
            key = self.owner.pop(rid, None)
            if key is None:
                continue
            del self._expires[rid]
            group = self.by_owner[key]
            group.discard(rid)
            if not group:
                del self.by_owner[key]

    def keep_only(self, held: frozenset[str]) -> None:
        """The engine's holds are `held` (read after every record here was made): drop the
        records of requests that hold nothing."""
        self.forget([rid for rid in self.owner if rid not in held])

    def _expire(self) -> None:
        now = self.clock()
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            expires, rid = heapq.heappop(expiry)
            if self._expires.get(rid) == expires:  # not forgotten (or recorded again) since
                self.forget([rid])
        if len(expiry) > 2 * len(self.owner) + 64:  # entries of forgotten records
            self._expiry = [(t, rid) for t, rid in expiry if self._expires.get(rid) == t]
            heapq.heapify(self._expiry)
