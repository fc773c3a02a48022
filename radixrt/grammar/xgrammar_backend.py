"""GrammarBackend on xgrammar: compiles on a thread pool against the model's tokenizer and
caches compiled grammars by (kind, text). Imports torch and xgrammar (the scheduler process
and the Engine only; never the front)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from radixrt.grammar.base import CompileOutcome
from radixrt.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


MIN_BATCH_FILL = 8  # fewer stale masks are filled one by one (no thread hand-off)
COMPILE_THREADS = 4  # threads xgrammar uses inside one compile


class CompileError(ValueError):
    """The spec does not compile (bad regex, schema or grammar)."""


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: xgr.CompiledGrammar
    # [W] int32 ANDed into every mask, or None. JSON schemas: tokens with raw control bytes
    # are banned (xgrammar 0.2.9 lets maxLength strings take them, which JSON forbids)
    and_mask: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Ticket:
    spec: GrammarSpec
    future: Future
    deadline: float  # clock() value after which the compile counts as timed out


class XGrammarBackend:
    """See the module docstring. The tokenizer is loaded (and xgrammar's TokenizerInfo built)
    on the first compile, on a worker thread. `clock` is for tests."""

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        compile_timeout_s: float = 30.0,
        num_threads: int = 2,
        mask_threads: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size  # the model's (logits width); may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.clock = clock
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # guards _compiler's creation
        self._compiler: xgr.GrammarCompiler | None = None
        self._no_control: np.ndarray | None = None  # [W] int32: tokens without bytes < 0x20
        self._cache: dict[GrammarSpec, Future] = {}  # scheduler thread only
        self.mask_threads = mask_threads
        self._batch: xgr.BatchGrammarMatcher | None = None  # made on first use

    # ---- GrammarBackend ----
    def submit(self, spec: GrammarSpec) -> Ticket:
        future = self._cache.get(spec)
        if future is None:
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
        return Ticket(spec, future, self.clock() + self.compile_timeout_s)

    def poll(self, ticket: Ticket) -> CompileOutcome | None:
        f = ticket.future
        if f.done():
            error = f.exception()
            if error is None:
                return CompileOutcome(grammar=f.result())
            if not isinstance(error, CompileError):  # not the request's fault
                logger.error("compiling a %s failed", ticket.spec.kind, exc_info=error)
                message = f"internal error compiling the {ticket.spec.field}: {error!r}"
                return CompileOutcome(error=message, internal=True)
            return CompileOutcome(error=str(error))
        if self.clock() > ticket.deadline:
            return CompileOutcome(
                error=f"compiling the {ticket.spec.field} took longer than "
                f"{self.compile_timeout_s:g} s (the time limit)"
            )
        return None

    def wait(self, tickets: Sequence[Ticket], timeout_s: float) -> None:
        if tickets:
            wait_futures([t.future for t in tickets], timeout_s, return_when=FIRST_COMPLETED)

    def new_matcher(self, grammar: Compiled) -> XGrammarMatcher:
        return XGrammarMatcher(grammar, self.vocab_size)

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
        """Stop the workers (compiles queued but not started are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- worker side ----
    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from radixrt.hf_dir import load_tokenizer

                tok = load_tokenizer(self.model_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # threads of one compile (its token-mask cache); the pool runs several
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
                self._no_control = _no_control_mask(
                    info, self.vocab_size, [*info.stop_token_ids, *tok.all_special_ids]
                )
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> Compiled:
        c = self.compiler()
        try:
            if spec.kind == "regex":
                return Compiled(c.compile_regex(spec.text))
            if spec.kind == "json_schema":
                # compact JSON (no free whitespace): bounded outputs, more forced tokens
                grammar = c.compile_json_schema(spec.text, any_whitespace=False)
                return Compiled(grammar, self._no_control)
            if spec.kind == "structural_tag":
                return Compiled(c.compile_structural_tag(spec.text))
            assert spec.kind == "ebnf", spec.kind
            return Compiled(c.compile_grammar(spec.text))
        except (RuntimeError, ValueError, TypeError, xgr.InvalidStructuralTagError) as e:
            message = _LOCATION.sub("", str(e).strip())
            raise CompileError(f"invalid {spec.field}: {message}") from None


class XGrammarMatcher:
    """GrammarMatcher on xgrammar's matcher; the mask of the current state is computed once
    (into a host int32 buffer) and reused by `next_mask` and `forced_token`."""

    def __init__(self, grammar: Compiled, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(grammar.grammar)
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


def _no_control_mask(info: xgr.TokenizerInfo, vocab_size: int, keep_ids) -> np.ndarray:
    """[ceil(V / 32)] int32: bit t set unless token t's bytes hold a control byte (< 0x20);
    `keep_ids` (stop and special tokens) stay allowed. Ids past the tokenizer's vocabulary
    (a padded model vocabulary) decode to b"" and stay allowed too (xgrammar masks them).
    Not `info.special_token_ids`: for a padded vocabulary it lists every padding id, one
    FFI call each, which under GIL contention took minutes."""
    allowed = np.ones(vocab_size, dtype=bool)
    keep = set(keep_ids)
    for t, piece in enumerate(info.decoded_vocab[:vocab_size]):
        if t not in keep and any(b < 0x20 for b in piece):
            allowed[t] = False
    padded = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    padded[:vocab_size] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32).copy()
