"""The scheduler half of structured output (a feature at the scheduler's hooks; plain Python,
no torch).

Life of a constrained request: `add_request` / `add_fork` submit its GrammarSpec to the backend
and it waits (grammar-pending: it has a ticket in `_tickets`, skipped by admission, other
requests go ahead) until `schedule()` polls the compile done. A compile error or timeout
finishes it with FinishReason.ERROR and `invalid_request` (a 400); `drain_finished()` hands such
requests to EngineCore. Then every sequence (an n > 1 request: every child) holds its own
matcher (in `_matchers`, dropped when it finishes); its rows carry the matcher's next-token
bitmask and wait for their result on the host (`PlanRow.waits_for_result`: the mask of step N+1
needs step N's token), and the matcher accepts every token appended. With a host-side proposer
(ngram, radix) a constrained row drafts too: its drafts are cut at the first one the grammar
refuses, and the row carries one mask per sample (the state after each draft; the matcher is
rolled back after reading them), so a verify position samples exactly what masked decoding
would. Draft-model drafts (made on the device) are not checked: constrained rows do not draft
with them. A row whose matcher terminated (it accepted a stop token) stops with
FinishReason.STOP.

Jump-forward (on by default): after the tokens of a step are accepted, while the grammar
allows exactly one token, that token is appended without sampling (log-prob 0: it has
probability 1 under the masked distribution); the run is then fed as one extend chunk. The
tokens are the ones masked sampling would pick, so outputs are identical with it off (seeded
sampling draws per output position, so seeded outputs are identical too).

Preemption keeps a request's host tokens and its matcher, which only ever saw host tokens
(results of a dropped step never reach it), so nothing needs rebuilding;
`_check_grammar_integrity` asserts matcher and tokens agree.
"""

from __future__ import annotations

from typing import Any

from radixrt.deltas import FinishReason
from radixrt.grammar.spec import grammar_spec
from radixrt.plan import BlockOp, PlanRow
from radixrt.scheduler.features import SchedulerFeature, StepTables
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.stats import SchedulerCounters


class NoGrammar(SchedulerFeature):
    """An engine without a grammar backend: constrained requests are refused."""

    def on_add(self, req: Request) -> None:
        spec = grammar_spec(req.params)
        if spec is not None:
            raise ValueError(
                f"{spec.field} needs structured output, which this engine does not have "
                "(no grammar backend: install xgrammar)"
            )


class GrammarFeature(SchedulerFeature):
    def __init__(
        self,
        backend: Any,  # radixrt.grammar.base.GrammarBackend
        queues: RequestQueues,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        *,
        jump_forward: bool = True,
        jump_forward_retokenize: bool = False,
    ) -> None:
        self.backend = backend
        self.queues = queues
        self.lifecycle = lifecycle
        self.stats = stats
        self.jump_forward = jump_forward
        self.jump_forward_retokenize = jump_forward_retokenize
        self._tickets: dict[Request, Any] = {}  # grammar-pending requests: their compiles
        self._matchers: dict[Request, Any] = {}  # constrained sequences: their GrammarMatcher

    # ---- per-request state (for speculation, tests and introspection) ----
    def constrained(self, req: Request) -> bool:
        """Whether `req` is a sequence with a matcher (its output is constrained)."""
        return req in self._matchers

    def matcher(self, req: Request) -> Any:
        """The sequence's GrammarMatcher, or None."""
        return self._matchers.get(req)

    def compiling(self, req: Request) -> bool:
        """Whether `req` waits for its grammar's compile."""
        return req in self._tickets

    # ---- hooks ----
    def on_add(self, req: Request) -> None:
        """Start compiling `req`'s grammar (it stays grammar-pending)."""
        spec = grammar_spec(req.params)
        if spec is not None:
            self._tickets[req] = self.backend.submit(spec)

    def before_schedule(self, ops: list[BlockOp]) -> None:
        self._poll()

    def admissible(self, req: Request) -> bool:
        return req not in self._tickets  # grammar-pending: its compile runs

    def before_rows(self, reqs: list[Request]) -> None:
        self._fill_masks(reqs)

    def on_row(
        self, req: Request, row: PlanRow, drafts: list[int], samples: bool, tables: StepTables
    ) -> None:
        if samples and req in self._matchers:  # the next mask needs this step's token
            tables.masks[id(row)] = self._masks(req, drafts)
            row.waits_for_result.append("grammar")

    def on_token(self, req: Request, token: int) -> FinishReason | None:
        """Feed an appended token to the request's matcher; STOP once it terminated."""
        m = self._matchers.get(req)
        if m is None:
            return None
        assert m.accept(token), f"token {token} is outside {req.rid}'s grammar"
        return FinishReason.STOP if m.is_terminated() else None

    def after_update(self, changed: list[Request]) -> None:
        """Jump-forward for the running constrained requests that got tokens; then fail
        those whose grammar allows no next token (`_dead_end`). One that raises fails alone
        (its group with it): the failed requests join `changed`."""
        matchers = self._matchers
        reqs = [r for r in changed if r in matchers and r.status is RequestStatus.RUNNING]
        if not reqs:
            return
        self._fill_masks(reqs)
        for req in reqs:
            if req.status is not RequestStatus.RUNNING:
                continue  # its group failed with an earlier member
            try:
                if self.jump_forward and self._jump_forward(req):
                    continue
                if req.status is RequestStatus.RUNNING:
                    self._dead_end(req)
            except Exception as e:
                changed += self.lifecycle.fail(req, e)

    def _dead_end(self, req: Request) -> None:
        """Stop `req` with ERROR (the request's fault: a 400) when its grammar allows no
        token now: the grammar's language is empty past this point (`root ::= "a" b` with
        `b ::= b`), and a sample from an all-masked row would be garbage."""
        m = self._matchers[req]
        if m.is_terminated():
            return
        mask = m.next_mask()
        if mask.count(0) != len(mask):
            return
        field = grammar_spec(req.params).field
        req.error = (
            f"invalid {field}: no output can match it (no token may follow the "
            f"{req.num_output} output tokens it allowed)"
        )
        req.invalid_request = True
        self.stats.grammar_errors += 1
        was_waiting = req.status is RequestStatus.WAITING
        self.lifecycle.stop(req, FinishReason.ERROR)
        if was_waiting:
            self.lifecycle.report(req)

    def on_finish(self, req: Request) -> None:
        self._tickets.pop(req, None)
        self._matchers.pop(req, None)

    def check_integrity(self) -> None:
        for req, m in self._matchers.items():
            assert req not in self._tickets and not req.is_finished
            assert m.num_accepted == req.num_output, (
                f"{req.rid}: matcher saw {m.num_accepted} tokens, the request has {req.num_output}"
            )
        assert all(r.status is RequestStatus.WAITING for r in self._tickets)

    # ---- for the engine loop and speculation ----
    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a pending compile finishes (returns at once when
        none is pending). For a loop whose step planned nothing."""
        tickets = list(self._tickets.values())
        if tickets:
            self.backend.wait(tickets, timeout_s)

    def restricts_drafts(self, req: Request) -> bool:
        return self.constrained(req)

    def allowed_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar allows (the matcher is left
        as it was); `drafts` as they are for an unconstrained request."""
        m, n = self._matchers.get(req), 0
        if m is None:
            return drafts
        while n < len(drafts) and not m.is_terminated() and m.accept(drafts[n]):
            n += 1
        m.rollback(n)
        return drafts[:n]

    # ---- compiles ----
    def _poll(self) -> None:
        """Admit compiled grammars: give each waiting sequence its matcher; fail the requests
        whose compile failed or timed out (or whose start raised: that request alone)."""
        tickets = self._tickets
        for req in [r for r in self.queues.waiting if r in tickets]:
            outcome = self.backend.poll(tickets[req])
            if outcome is None:
                continue
            del tickets[req]
            if outcome.error is not None:
                self._reject(req, outcome.error, not outcome.internal, outcome.unavailable)
                continue
            self.stats.grammar_requests += 1
            try:
                self._start_matchers(req, outcome.grammar)
            except Exception as e:  # a bug for one request fails that request (group) only
                self.lifecycle.fail_outside_update(req, e)

    def _start_matchers(self, req: Request, grammar: Any) -> None:
        """Give each sequence of a waiting request its matcher; jump-forward a lone one."""
        g = req.group
        seqs = [req] if g is None else list(g.children)
        for seq in seqs:
            m = self._matchers[seq] = self.backend.new_matcher(grammar)
            for token in seq.output_token_ids:  # none yet, unless re-added
                assert m.accept(token)
        if g is None and not (self.jump_forward and self._jump_forward(req)):
            self._dead_end(req)  # after forced tokens (the start is checked at compile)

    def _reject(self, req: Request, error: str, invalid: bool, unavailable: bool = False) -> None:
        """Finish a waiting request (an n > 1 request: all its children) with ERROR: the
        client's fault (`invalid_request`: a 400) or, not `invalid`, the engine's (a 500;
        `unavailable`: the compiler is down, a 503)."""
        if invalid:
            self.stats.grammar_errors += 1
        else:
            self.stats.failed_requests += 1
        g = req.group
        seqs = [req] if g is None else list(g.children)
        for seq in seqs:
            seq.error, seq.invalid_request, seq.unavailable = error, invalid, unavailable
        if g is None:
            self.lifecycle.stop(req, FinishReason.ERROR)
        else:
            self.lifecycle.abort(req.rid, FinishReason.ERROR)
        self.lifecycle.report(*seqs)

    # ---- masks and jump-forward ----
    def _fill_masks(self, reqs: list[Request]) -> None:
        """Compute the next masks of these requests' matchers in one batch: before planning
        their rows, and before jump-forward looks at them."""
        matchers = [m for m in map(self._matchers.get, reqs) if m is not None]
        if matchers:
            self.backend.fill_masks(matchers)

    def _masks(self, req: Request, drafts: list[int]) -> bytes:
        """The masks of a row's samples, back to back: the current state's, then the state
        after each draft (the matcher is left as it was). The drafts must be allowed
        (`allowed_drafts`)."""
        m = self._matchers[req]
        masks = [m.next_mask()]
        for token in drafts:
            assert m.accept(token), f"draft {token} is outside {req.rid}'s grammar"
            # a draft the grammar ends on (its stop token) ends the request: the sample after
            # it is never used, and a terminated matcher has no next mask
            masks.append(b"\xff" * len(masks[0]) if m.is_terminated() else m.next_mask())
        m.rollback(len(drafts))
        return b"".join(masks)

    def _jump_forward(self, req: Request) -> bool:
        """Append the tokens the grammar forces (see the module docstring); True when that
        finished the request. With `jump_forward_retokenize`, and always for a structural
        tag, also the tokens of the string the grammar forces (xgrammar's own tokenization of
        it: not output-identical)."""
        m, p = self._matchers[req], req.params
        # a structural tag's fixed text (tool-call wrappers) sampled token by token comes out
        # a character or two per token and spends the call's budget: append it whole
        retokenize = self.jump_forward_retokenize or p.structural_tag is not None
        queue: list[int] = []
        while req.num_output < req.max_tokens:
            token = queue.pop(0) if queue else m.forced_token()
            if token is None and retokenize:
                queue = m.forced_string_tokens()
                token = queue.pop(0) if queue else None
            if token is None:
                return False
            req.seq_token_ids.append(token)
            if p.logprobs:
                req.output_logprobs.append(0.0)
            if p.top_logprobs:
                req.output_top_logprobs.append([(token, 0.0)])
            self.stats.generated_tokens += 1
            self.stats.grammar_forced_tokens += 1
            reason = self.on_token(req, token) or self.lifecycle.stop_reason(req, token)
            if reason is not None:
                was_waiting = req.status is RequestStatus.WAITING
                self.lifecycle.stop(req, reason)
                if was_waiting:
                    self.lifecycle.report(req)
                return True
        return False
