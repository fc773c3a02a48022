"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merged tokens. Two decoders:
`ByteDecoder` (a per-token byte table and an incremental UTF-8 decoder, for tokenizers
`TokenBytes.build` can read: byte-level and byte-fallback BPE) and `WindowDecoder` (any
tokenizer: decodes a window of already-emitted tokens and only emits text once it no
longer ends in an incomplete character, U+FFFD). Text that could be the start of a stop
string is held back until it is decided.

Cost per `add`: a table lookup per token (or decoding the window's few tokens), and
searching only the text not yet returned (the held-back tail, shorter than the longest
stop string, plus the new text): O(number of stop strings x (longest stop string + new
text)), independent of how long the output already is. A stop string cannot start in
text already returned (that text was returned because no stop string could start there).
Stop regexes search the same way, with the held-back tail capped at
`STOP_REGEX_WINDOW` characters and all their searches of one output under
`STOP_REGEX_BUDGET_S` of time (a regex that backtracks catastrophically raises
`StopRegexTimeout` instead of blocking the caller).
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from typing import Any

from radixrt.token_bytes import TokenBytes

CONTEXT_TOKENS = 4  # prompt tokens decoded before the output, for the first tokens' spacing
# a stop regex's match is found when it lies within this many characters of held-back text
# plus the new text (older text is returned, so every search is bounded)
STOP_REGEX_WINDOW = 1024
# time all stop-regex searches of one output may take (they run on the server's event loop)
STOP_REGEX_BUDGET_S = 0.5


class StopRegexTimeout(ValueError):
    """The output's stop-regex searches took longer than `STOP_REGEX_BUDGET_S`."""


class WindowDecoder:
    """Text of a token stream by decoding windows with the tokenizer: a window of
    already-emitted tokens gives the next token's spacing, and text is only emitted once it
    no longer ends in an incomplete character (U+FFFD). Works with any tokenizer; two small
    decodes per token."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, context_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # ids[prefix_offset:read_offset] were decoded already (they give the next token's
        # spacing); ids[read_offset:] wait for a complete character
        self.ids: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode(self, new_ids: Sequence[int], final: bool) -> str:
        out = []
        for tok in new_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix) :])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        if final and self.read_offset < len(self.ids):  # flush an incomplete tail
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            out.append(self._decode(self.ids[self.prefix_offset :])[len(prefix) :])
            self.read_offset = len(self.ids)
        del self.ids[: self.prefix_offset]  # keep only the decode window
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        return "".join(out)


class ByteDecoder:
    """Text of a token stream from a per-token byte table and an incremental UTF-8
    decoder: O(new tokens) per call, and the joined output equals the tokenizer's decode of
    the whole stream. The decoder is primed with the prompt's last tokens, so a character
    the prompt's last token starts and the output completes comes out with the output."""

    def __init__(
        self, token_bytes: TokenBytes, skip_special_tokens: bool, context_ids: Sequence[int]
    ):
        self.token_bytes = token_bytes
        self.skip_special_tokens = skip_special_tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.utf8.decode(token_bytes.join(list(context_ids[-CONTEXT_TOKENS:]), skip_special_tokens))

    def decode(self, new_ids: Sequence[int], final: bool) -> str:
        data = self.token_bytes.join(new_ids, self.skip_special_tokens)
        return self.utf8.decode(data, final)


class IncrementalDetokenizer:
    """Streamed text of one output with its stop strings and stop regexes. Decodes with
    `token_bytes` (`TokenBytes.build(tokenizer)`, built once per tokenizer) when given, else
    by windows.

    A stop regex ends the text at its first match; text that could still grow into a match
    (a partial match of the `regex` module at its end) is held back until it is decided, so
    a match is never split by what was already returned. `include_stop` keeps the matched
    stop string (or regex match) in the text. Before `min_tokens` tokens, nothing is
    searched for stops (they do not end the output yet)."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
        token_bytes: TokenBytes | None = None,
        stop_regex: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.stop = tuple(stop)
        self.stop_regex = [_compile(r) for r in stop_regex]
        self.regex_budget_s = STOP_REGEX_BUDGET_S  # search time left to this output
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.num_tokens = 0  # tokens fed so far
        self.decoder: WindowDecoder | ByteDecoder = (
            WindowDecoder(tokenizer, skip_special_tokens, context_ids)
            if token_bytes is None
            else ByteDecoder(token_bytes, skip_special_tokens, context_ids)
        )
        self.pending = ""  # decoded text not returned yet (may start a stop string)
        self.stopped = False  # a stop string was found (nothing more is returned)

    @classmethod
    def for_params(
        cls,
        tokenizer: Any,
        params: Any,
        context_ids: Sequence[int] = (),
        token_bytes: TokenBytes | None = None,
    ) -> IncrementalDetokenizer:
        """The detokenizer of a request with these SamplingParams (stops, special tokens)."""
        return cls(
            tokenizer,
            params.stop,
            params.skip_special_tokens,
            context_ids,
            token_bytes,
            params.stop_regex,
            params.include_stop_str_in_output,
            params.min_tokens,
        )

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Feed newly generated ids; return the text that is now safe to emit (with
        `final`, everything left, up to a stop string)."""
        if self.stopped:
            return ""
        text = self.decoder.decode(new_ids, final)
        self.num_tokens += len(new_ids)
        if not (self.stop or self.stop_regex):
            return text
        self.pending += text
        if self.num_tokens < self.min_tokens:  # stops do not count yet
            text, self.pending = self.pending, ""
            return text
        return self._release(final)

    def _release(self, final: bool) -> str:
        text = self.pending
        # (start, end) of each stop string's / regex's first match
        hits = [(i, i + len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        hits += [m.span() for r in self.stop_regex if (m := self._search(r, text)) is not None]
        if hits:
            start, end = min(hits)
            self.stopped = True
            self.pending = ""
            return text[: end if self.include_stop else start]
        keep = 0 if final else _held_back(text, self.stop)
        if self.stop_regex and not final:
            partial = (self._search(r, text, partial=True) for r in self.stop_regex)
            held = max(len(text) - m.start() if m is not None else 0 for m in partial)
            keep = max(keep, min(held, STOP_REGEX_WINDOW))
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _search(self, pattern: Any, text: str, partial: bool = False) -> Any:
        """`pattern.search` within what is left of this output's time budget."""
        start = time.perf_counter()
        try:
            return pattern.search(text, partial=partial, timeout=max(self.regex_budget_s, 1e-3))
        except TimeoutError:
            self.regex_budget_s = 0.0
            raise StopRegexTimeout(
                f"stop_regex {pattern.pattern[:60]!r} took over {STOP_REGEX_BUDGET_S:g} s to "
                "search this output (it backtracks too much): simplify it"
            ) from None
        finally:
            self.regex_budget_s -= time.perf_counter() - start


def _compile(pattern: str) -> Any:
    import regex

    return regex.compile(pattern)


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
