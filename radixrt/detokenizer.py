"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merged tokens; this keeps a
window of already-emitted tokens and only emits text once it no longer ends in an
incomplete character (U+FFFD). Stop strings are searched in the accumulated text; text
that could be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        # A few context tokens before the output give the first tokens their spacing.
        self.ids: list[int] = list(context_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output so far (stop string cut off once found)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False  # a stop string was found

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Feed newly generated ids; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        for tok in new_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        if final and self.read_offset < len(self.ids):  # flush an incomplete tail
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        limit = len(self.text)
        if self.stop:
            search_from = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                limit = len(self.text)
            elif not final:
                limit = max(self.emitted, limit - self._held_back())
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
