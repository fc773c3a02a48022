"""What a configuration sent, and the hit rate a perfect cache would have had on it.

Every client records its requests in a `CallLog` in send order. The optimum replays them
through a token trie: each request reuses the longest prefix of its prompt that an earlier
request's prompt or output holds (an infinite cache that forgets nothing), capped as the
engine caps a match (`match_limit`); then its prompt and output go into the trie.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("gen", "score", "hint")  # generate | score one continuation | prefill ahead (0 tokens)


@dataclass(frozen=True)
class Call:
    kind: str  # one of KINDS
    prompt_ids: tuple[int, ...]
    max_tokens: int  # 0 for scores and hints
    match_limit: int  # prompt tokens the engine may serve from its cache (the rest is computed)
    output_ids: tuple[int, ...] = ()

    def key(self) -> tuple:
        """What two configurations must agree on (not the outputs: a grammar-constrained
        gen on random weights may pick other tokens, nothing depends on them)."""
        return (self.kind, hash(self.prompt_ids), len(self.prompt_ids), self.max_tokens)


class CallLog:
    """Requests of one run in send order. Thread-safe: `reserve` a slot when sending,
    `put` the call there when it finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call | None] = []

    def reserve(self, n: int = 1) -> int:
        with self._lock:
            self._calls += [None] * n
            return len(self._calls) - n

    def put(self, index: int, call: Call) -> None:
        with self._lock:
            self._calls[index] = call

    @property
    def calls(self) -> list[Call]:
        """The finished calls in send order (a slot whose request failed is left out)."""
        with self._lock:
            return [c for c in self._calls if c is not None]


@dataclass(frozen=True)
class Replay:
    prompt_tokens: int  # over every request sent (hints too)
    optimal_cached_tokens: int  # what a perfect cache serves of them
    unique_tokens: int  # tokens `calls` add to the cache (all of them: the trie's size)

    @property
    def optimal_hit_rate(self) -> float:
        return self.optimal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(calls: Sequence[Call], history: Sequence[Call] = ()) -> Replay:
    """Replay `calls` (send order) through a perfect infinite cache that served `history`
    before them (counted: `calls` only). A finished request leaves its prompt and all its
    output tokens but the last (which was sampled, never fed to the model) in the cache."""
    root: dict = {}
    prompt = cached = unique = 0
    for n, call in enumerate((*history, *calls)):
        counted = n >= len(history)
        node, hit = root, True
        for i, token in enumerate(call.prompt_ids + call.output_ids[:-1]):
            nxt = node.get(token)
            if nxt is None:
                hit = False
                nxt = node[token] = {}
                unique += counted
            elif hit and i < call.match_limit:
                cached += counted
            node = nxt
        prompt += counted * len(call.prompt_ids)
    return Replay(prompt, cached, unique)


def same_calls(a: Sequence[Call], b: Sequence[Call]) -> bool:
    """Whether two runs sent the same generate and score requests (in any order; hints,
    which only some configurations send, are left out)."""
    return _keys(a) == _keys(b)


def _keys(calls: Sequence[Call]) -> Counter:
    return Counter(c.key() for c in calls if c.kind != "hint")
