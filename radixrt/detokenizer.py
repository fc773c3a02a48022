"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merged tokens; this keeps a
window of already-emitted tokens and only emits text once it no longer ends in an
incomplete character (U+FFFD). Text that could be the start of a stop string is held
back until it is decided.

Cost per `add`: decoding the few tokens of the window, and searching only the text not
yet returned (the held-back tail, shorter than the longest stop string, plus the new
text): O(number of stop strings x (longest stop string + new text)), independent of how
long the output already is. A stop string cannot start in text already returned (that
text was returned because no stop string could start there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 4  # prompt tokens decoded before the output, for the first tokens' spacing


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
        # ids[prefix_offset:read_offset] were decoded already (they give the next token's
        # spacing); ids[read_offset:] wait for a complete character
        self.ids: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.pending = ""  # decoded text not returned yet (may start a stop string)
        self.stopped = False  # a stop string was found (nothing more is returned)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Feed newly generated ids; return the text that is now safe to emit (with
        `final`, everything left, up to a stop string)."""
        if self.stopped:
            return ""
        for tok in new_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.pending += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        if final and self.read_offset < len(self.ids):  # flush an incomplete tail
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.pending += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        del self.ids[: self.prefix_offset]  # keep only the decode window
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        return self._release(final)

    def _release(self, final: bool) -> str:
        text = self.pending
        if not self.stop:
            self.pending = ""
            return text
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)]
        keep = 0 if final else _held_back(text, self.stop)
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        # candidate starts: positions in the last len(s) - 1 characters holding s[0]
        pos = text.find(s[0], max(0, len(text) - len(s) + 1))
        while pos >= 0 and len(text) - pos > best:
            if s.startswith(text[pos:]):
                best = len(text) - pos
                break
            pos = text.find(s[0], pos + 1)
    return best
