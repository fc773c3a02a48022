"""Deliberately simple reference models of the prefix caches (for tests only).

`NaivePrefixCache` mirrors `RadixCache`: a list of cached (tokens, per-token block)
entries; a match is the longest common prefix over all entries. It does not model LRU
eviction: after the real cache evicted, `restrict_to` replaces the entries with what the
real cache still holds, after checking that this is a subset of the old content with the
same blocks (so eviction may only forget, never invent or move, anything).

`NaiveBlockHashCache` mirrors `BlockHashCache` with exact token-prefix keys instead of
hashes: {tokens[: (i + 1) * B] -> block}.

`peek_continuation` models the radix tree's read-only lookup: the cached tokens after a fully
cached query, following at each branch the continuation that the latest match or insert went
through (`history` logs every match and insert, in order).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def block_table(per_token: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """Block table for the first `num_tokens` positions: block i is the block recorded
    for the last position of its range (min(L, (i + 1) * B) - 1)."""
    return [
        per_token[min(num_tokens, (i + 1) * block_size) - 1]
        for i in range(-(-num_tokens // block_size))
    ]


class NaivePrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.entries: list[tuple[tuple[int, ...], list[int]]] = []
        self.history: list[tuple[int, ...]] = []  # tokens of every match / insert, in order

    def _longest(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """(length, per-token blocks) of the longest cached prefix of `tokens`."""
        best_len, best_blocks = 0, []
        for key, per_token in self.entries:
            n = 0
            for a, b in zip(key, tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best_len, best_blocks = n, per_token[:n]
            elif n == best_len and n:
                assert per_token[:n] == best_blocks, "one prefix, two block assignments"
        return best_len, best_blocks

    def match(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """(num_cached_tokens, block table) of the longest cached prefix."""
        self.history.append(tuple(tokens))
        n, per_token = self._longest(tokens)
        return n, block_table(per_token, n, self.block_size)

    def per_token_blocks(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        return self._longest(tokens)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache `tokens` (cached positions keep their blocks); returns new tokens."""
        self.history.append(tuple(tokens))
        n, per_token = self._longest(tokens)
        if n == len(tokens):
            return 0
        per_token = per_token + [blocks[p // self.block_size] for p in range(n, len(tokens))]
        self.entries.append((tuple(tokens), per_token))
        return len(tokens) - n

    def peek_continuation(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` cached tokens after `tokens` when all of it is cached; at a
        branch, the next token of the latest logged match / insert through the context."""
        ctx = tuple(tokens)
        if not ctx or self._longest(ctx)[0] < len(ctx):
            return []
        out: list[int] = []
        while len(out) < max_tokens:
            n = len(ctx)
            nexts = {k[n] for k, _ in self.entries if len(k) > n and k[:n] == ctx}
            if not nexts:
                break

            recency = {
                t: max((i for i, h in enumerate(self.history) if h[: n + 1] == ctx + (t,)))
                for t in nexts
            }
            t = max(nexts, key=recency.__getitem__)
            out.append(t)
            ctx += (t,)
        return out

    def num_tokens(self) -> int:
        """Distinct cached non-empty prefixes (= tokens in an equivalent radix tree)."""
        total, prev = 0, ()
        for key, _ in sorted(self.entries):
            common = 0
            for a, b in zip(key, prev):
                if a != b:
                    break
                common += 1
            total += len(key) - common
            prev = key
        return total

    def restrict_to(self, paths: Iterable[tuple[tuple[int, ...], list[int]]]) -> None:
        """Keep only `paths` (what the real cache still holds); each must already be
        cached here with the same per-token blocks."""
        paths = list(paths)
        for key, per_token in paths:
            n, mine = self._longest(key)
            assert n == len(key), f"path {key} was not cached before"
            assert mine == list(per_token), f"path {key} changed blocks"
        self.entries = [(tuple(k), list(b)) for k, b in paths]


class NaiveBlockHashCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cached: dict[tuple[int, ...], int] = {}  # full-block prefix -> block

    def match(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        bs, blocks = self.block_size, []
        for i in range(len(tokens) // bs):
            b = self.cached.get(tuple(tokens[: (i + 1) * bs]))
            if b is None:
                break
            blocks.append(b)
        return len(blocks) * bs, blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        bs, new = self.block_size, 0
        for i in range(len(tokens) // bs):
            key = tuple(tokens[: (i + 1) * bs])
            if key not in self.cached:
                self.cached[key] = blocks[i]
                new += bs
        return new

    def restrict_to_blocks(self, still_cached: set[int]) -> None:
        """Forget entries whose block the real cache no longer holds (after evict)."""
        self.cached = {k: b for k, b in self.cached.items() if b in still_cached}
