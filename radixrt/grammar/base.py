"""The scheduler's view of grammars: opaque handles behind two small protocols (torch-free).

The scheduler submits a request's `GrammarSpec` when it is added, polls the ticket each step
(the request waits, grammar-pending, while its grammar compiles in a worker process), then holds
one `GrammarMatcher` per sequence: it asks it for the next token bitmask (bytes that go into
the plan row) and feeds it every token the sequence gets. A compile error's message starts
with the SamplingParams field at fault (`GrammarSpec.field`); the server names the request
field the client used instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixrt.grammar.spec import GrammarSpec


@dataclass(frozen=True, slots=True)
class CompileOutcome:
    """A finished compile: exactly one of `grammar` (an opaque compiled grammar for
    `GrammarBackend.new_matcher`) and `error` (what the client did wrong, the timeout, or
    with `internal` an engine fault such as a tokenizer that does not load)."""

    grammar: Any = None
    error: str | None = None
    internal: bool = False  # the error is the engine's (a 500), not the request's (a 400)
    # with internal: the compiler is down for good (a 503: the replica cannot serve grammars)
    unavailable: bool = False


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """Compile cache and compile workers, since start (`GrammarBackend.stats`)."""

    grammar_cache_hits: int = 0  # constrained requests whose grammar was cached (or compiling)
    grammar_cache_misses: int = 0  # constrained requests that started a compile
    grammar_cache_evictions: int = 0  # compiled grammars dropped to stay within the bound
    grammar_cache_bytes: int = 0  # bytes the cached grammars take now
    grammar_compile_timeouts: int = 0  # compiles stopped at the time limit (worker killed)
    grammar_compile_preemptions: int = 0  # compiles stopped for a waiting one (requeued)
    grammar_compiler_failed: int = 0  # 1 once the compiler could not start or died


class GrammarMatcher(Protocol):
    """Grammar state of one sequence. Not thread-safe: the scheduler thread owns it."""

    num_accepted: int  # tokens accepted so far (== the sequence's output tokens)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts checked against
        the grammar are accepted, their masks read, then rolled back)."""
        ...

    def next_mask(self) -> bytes:
        """The tokens allowed next as a packed bitmask: little-endian int32 words, bit t % 32
        of word t // 32 set when token t is allowed; ceil(vocab_size / 32) words."""
        ...

    def forced_token(self) -> int | None:
        """The only token allowed next, or None when there are several (jump-forward)."""
        ...

    def forced_string_tokens(self) -> list[int]:
        """Tokens spelling the string the grammar forces next ([] if none), which the model
        might have tokenized otherwise (the string-level jump-forward option)."""
        ...


class GrammarBackend(Protocol):
    def start(self) -> None:
        """Start the compile workers now (warm before the first constrained request);
        idempotent. A backend without workers (or that starts them lazily) does nothing."""
        ...

    def submit(self, spec: GrammarSpec) -> Any:
        """Start compiling `spec` (or reuse the cached compile of the same (kind, text));
        returns a ticket for `poll`. Never blocks on the compile."""
        ...

    def poll(self, ticket: Any) -> CompileOutcome | None:
        """None while the compile runs (and its time limit has not passed)."""
        ...

    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        """A fresh matcher (no tokens accepted) for a compiled grammar."""
        ...

    def wait(self, tickets: Sequence[Any], timeout_s: float) -> None:
        """Block up to `timeout_s` until one of these compiles finishes (at once if one
        has). The engine calls it when a step planned nothing and grammars are pending,
        instead of spinning on `poll` (a spinning loop also starves the compile threads of
        the GIL)."""
        ...

    def close(self) -> None:
        """Stop the compile workers; idempotent."""
        ...

    def stats(self) -> GrammarStats:
        """Counters for /metrics (all zero where the backend counts nothing)."""
        ...

    def check_integrity(self) -> None:
        """Assert the backend's internal invariants (its compile cache); a backend with
        no state to check does nothing."""
        ...

    def fill_masks(self, matchers: Sequence[GrammarMatcher]) -> None:
        """Compute these matchers' next masks together (in parallel where the backend can);
        `next_mask` / `forced_token` then return at once. Changes no result (a backend
        without batching does nothing)."""
        ...
