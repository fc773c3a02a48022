"""GrammarBackend on xgrammar: compiles in killable worker processes
(`radixrt.grammar.compile_pool`) against the model's tokenizer and caches compiled grammars by
(kind, text) in an LRU bounded in bytes. Imports torch and xgrammar (the scheduler process and
the Engine only; never the front)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from radixrt.grammar.base import CompileOutcome, GrammarStats
from radixrt.grammar.compile_pool import CompilePool, InternalCompileError
from radixrt.grammar.compile_worker import CompileError, TemplateReady, WorkerSetup
from radixrt.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

MIN_BATCH_FILL = 8  # fewer stale masks are filled one by one (no thread hand-off)
DEFAULT_CACHE_BYTES = 256 * 2**20  # compiled grammars kept (`Compiled.nbytes`)
ERROR_ENTRY_BYTES = 1024  # what a cached compile error counts


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: xgr.CompiledGrammar
    # [W] int32 ANDed into every mask, or None. JSON schemas: tokens with raw control bytes
    # are banned (xgrammar 0.2.9 lets maxLength strings take them, which JSON forbids)
    and_mask: np.ndarray | None = None
    # what the process holds for it: memory_size_bytes leaves out most of a deserialized
    # grammar, whose serialized length tracks the rest (tests/test_server_grammar_rss.py)
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Ticket:
    spec: GrammarSpec
    future: Future


@dataclass(slots=True)
class GrammarCacheStats:
    hits: int = 0  # submits that found their spec cached (compiled, failed or compiling)
    misses: int = 0  # submits that started a compile
    evictions: int = 0  # entries dropped to keep the cache within its bytes
    bytes: int = 0  # bytes the finished entries take
    entries: int = 0  # entries, compiling ones included


class XGrammarBackend:
    """See the module docstring. The worker processes start on `start()` (the server's
    scheduler process calls it at start-up) or on the first submit. A compile fails once it
    has run `compile_timeout_s` (waiting for a worker does not count); its worker is killed.
    Compiles that failed on the request's fault are cached too (a resubmitted slow grammar
    fails at once); internal failures are not."""

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        compile_timeout_s: float = 30.0,
        num_workers: int = 2,
        mask_threads: int = 4,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.vocab_size = vocab_size  # the model's (logits width); may exceed the tokenizer's
        self.setup = WorkerSetup(model_path, vocab_size, tuple(sorted(stop_token_ids)))
        self.compile_timeout_s = compile_timeout_s
        self.num_workers = num_workers
        self.cache_bytes = cache_bytes
        self.cache_stats = GrammarCacheStats()
        self._pool: CompilePool | None = None
        self._info: xgr.TokenizerInfo | None = None  # the manager thread's, from TemplateReady
        self._no_control: np.ndarray | None = None
        # scheduler thread only: spec -> compile, least recently used first; sizes of the
        # finished ones (None: not yet accounted)
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._sizes: dict[GrammarSpec, int | None] = {}
        self._compiling: set[GrammarSpec] = set()  # the entries whose size is None
        self.mask_threads = mask_threads
        self._batch: xgr.BatchGrammarMatcher | None = None  # made on first use
        self._encode: Callable[[str], list[int]] | None = None  # the tokenizer's, on first use
        self._encode_tried = False

    def start(self) -> None:
        """Start the compile workers and load the tokenizer (idempotent)."""
        self._encoder()
        if self._pool is None:
            self._pool = CompilePool(
                self.setup, self.num_workers, self.compile_timeout_s, self._decode
            )

    # ---- GrammarBackend ----
    def submit(self, spec: GrammarSpec) -> Ticket:
        future = self._cache.get(spec)
        if future is not None:
            self.cache_stats.hits += 1
            self._cache.move_to_end(spec)
        else:
            self.cache_stats.misses += 1
            self.start()
            assert self._pool is not None
            future = self._cache[spec] = self._pool.submit(spec)
            self._sizes[spec] = None
            self._compiling.add(spec)
        self._account()
        return Ticket(spec, future)

    def poll(self, ticket: Ticket) -> CompileOutcome | None:
        f = ticket.future
        if not f.done():
            return None
        self._account()
        if f.cancelled():  # the backend was closed
            return CompileOutcome(
                error="internal error: the grammar compiler stopped", internal=True
            )
        error = f.exception()
        if error is None:
            return CompileOutcome(grammar=f.result())
        if isinstance(error, CompileError):
            return CompileOutcome(error=str(error))
        assert isinstance(error, InternalCompileError), error
        down = self._pool is not None and self._pool.failure is not None
        if not down:  # a failed compiler was logged once, when it failed
            logger.error("compiling a %s failed: %s", ticket.spec.kind, error)
        return CompileOutcome(error=str(error), internal=True, unavailable=down)

    def wait(self, tickets: Sequence[Ticket], timeout_s: float) -> None:
        if tickets:
            wait_futures([t.future for t in tickets], timeout_s, return_when=FIRST_COMPLETED)

    def new_matcher(self, grammar: Compiled) -> XGrammarMatcher:
        return XGrammarMatcher(grammar, self.vocab_size, self._encoder())

    def _encoder(self) -> Callable[[str], list[int]] | None:
        """The model's tokenizer (text -> ids, no special tokens added), loaded once; None
        when it does not load (forced strings then take xgrammar's split)."""
        if not self._encode_tried:
            self._encode_tried = True
            from radixrt.hf_dir import load_tokenizer

            try:
                fast = load_tokenizer(self.setup.model_path).backend_tokenizer
            except (OSError, ValueError) as e:
                logger.warning("forced strings keep xgrammar's tokenization: %s", e)
            else:
                self._encode = lambda text: fast.encode(text, add_special_tokens=False).ids
        return self._encode

    def fill_masks(self, matchers: Sequence[XGrammarMatcher]) -> None:
        """Compute the masks of the matchers whose state changed, in one call on
        `mask_threads` threads (xgrammar's BatchGrammarMatcher); later `next_mask` /
        `forced_token` calls reuse them. A few matchers are filled one by one."""
        stale = [m for m in matchers if not m._fresh]
        if len(stale) < MIN_BATCH_FILL:
            return
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.mask_threads)
        bitmask = xgr.allocate_token_bitmask(len(stale), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in stale], bitmask)
        words = bitmask.numpy()
        for i, m in enumerate(stale):
            if m._and_mask is not None:
                words[i] &= m._and_mask
            m._words, m._fresh = words[i], True

    def close(self) -> None:
        """Kill the compile workers (queued compiles are cancelled)."""
        if self._pool is not None:
            self._pool.close()

    @property
    def pool(self) -> CompilePool | None:
        return self._pool

    def stats(self) -> GrammarStats:
        c = self.cache_stats
        p = self._pool.stats if self._pool is not None else None
        return GrammarStats(
            grammar_cache_hits=c.hits,
            grammar_cache_misses=c.misses,
            grammar_cache_evictions=c.evictions,
            grammar_cache_bytes=c.bytes,
            grammar_compile_timeouts=p.num_timeouts if p else 0,
            grammar_compile_preemptions=p.num_preemptions if p else 0,
            grammar_compiler_failed=int(self._pool is not None and self._pool.failure is not None),
        )

    def check_integrity(self) -> None:
        assert set(self._sizes) == set(self._cache)
        assert self._compiling == {spec for spec, n in self._sizes.items() if n is None}
        sizes = [n for n in self._sizes.values() if n is not None]
        assert self.cache_stats.bytes == sum(sizes)
        assert self.cache_stats.entries == len(self._cache)
        assert self.cache_stats.bytes <= self.cache_bytes or len(sizes) <= 1

    # ---- the cache ----
    def _account(self) -> None:
        """Count the bytes of compiles finished since the last call, then drop least
        recently used finished entries while the cache holds more than `cache_bytes`
        (the newest entry stays: matchers being made from it)."""
        s = self.cache_stats
        for spec in [spec for spec in self._compiling if self._cache[spec].done()]:
            f = self._cache[spec]
            self._compiling.discard(spec)
            if f.cancelled() or isinstance(f.exception(), InternalCompileError):
                del self._cache[spec], self._sizes[spec]  # the engine's fault: retry next time
                continue
            size = ERROR_ENTRY_BYTES if f.exception() is not None else _entry_bytes(f.result())
            self._sizes[spec] = size
            s.bytes += size
        if s.bytes <= self.cache_bytes:
            s.entries = len(self._cache)
            return
        for spec in list(self._cache):
            if s.bytes <= self.cache_bytes or len(self._cache) <= 1:
                break
            size = self._sizes[spec]
            if size is None:
                continue  # compiling
            del self._cache[spec], self._sizes[spec]
            s.bytes -= size
            s.evictions += 1
        s.entries = len(self._cache)

    # ---- the manager thread ----
    def _decode(self, ready: TemplateReady, spec: GrammarSpec, grammar_json: str) -> Compiled:
        if self._info is None:
            self._info = xgr.TokenizerInfo.deserialize_json(ready.tokenizer_info_json)
            self._no_control = np.frombuffer(ready.no_control_mask, dtype=np.int32).copy()
        grammar = xgr.CompiledGrammar.deserialize_json(grammar_json, self._info)
        and_mask = self._no_control if spec.kind == "json_schema" else None
        nbytes = grammar.memory_size_bytes + len(grammar_json)
        nbytes += 0 if and_mask is None else and_mask.nbytes
        return Compiled(grammar, and_mask, nbytes)


def _entry_bytes(compiled: Compiled) -> int:
    return compiled.nbytes


class XGrammarMatcher:
    """GrammarMatcher on xgrammar's matcher; the mask of the current state is computed once
    (into a host int32 buffer) and reused by `next_mask` and `forced_token`."""

    def __init__(
        self,
        grammar: Compiled,
        vocab_size: int,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        self._matcher = xgr.GrammarMatcher(grammar.grammar)
        self._encode = encode  # text -> token ids as the model's tokenizer writes them
        self._and_mask = grammar.and_mask
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, W] int32 cpu
        self._words = self._bitmask.numpy()[0]  # [W]: the current state's mask when _fresh
        self._fresh = False
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        if not self._matcher.accept_token(token):
            return False
        self.num_accepted += 1
        self._fresh = False
        return True

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            assert num_tokens <= self.num_accepted
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self._fresh = False

    def _fill(self) -> np.ndarray:
        if not self._fresh:
            self._matcher.fill_next_token_bitmask(self._bitmask, 0)
            self._words, self._fresh = self._bitmask.numpy()[0], True
            if self._and_mask is not None:
                self._words &= self._and_mask
        return self._words

    def next_mask(self) -> bytes:
        return self._fill().tobytes()

    def forced_string_tokens(self) -> list[int]:
        """Tokens of the string the grammar forces next: as the tokenizer writes it (what
        the model was trained on) as far as the grammar takes those tokens, else xgrammar's
        split of it. The matcher is left as it was."""
        text = self._matcher.find_jump_forward_string() if self._encode else ""
        if text:
            ids, taken = self._encode(text), 0
            for token in ids:
                if not self._matcher.accept_token(token):
                    break
                taken += 1
            if taken:
                self._matcher.rollback(taken)
                return ids[:taken]
        return list(self._matcher.find_jump_forward_tokens())

    def forced_token(self) -> int | None:
        words = self._fill()
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        w = int(words[nonzero[0]]) & 0xFFFFFFFF
        if w & (w - 1):
            return None
        return int(nonzero[0]) * 32 + w.bit_length() - 1
