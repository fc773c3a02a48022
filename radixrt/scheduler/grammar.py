"""The scheduler's structured-output logic (a mixin of `Scheduler`; plain Python, no torch).

Life of a constrained request: `add_request` / `add_fork` submit its GrammarSpec to the
backend and it waits (grammar-pending: `req.grammar_ticket` set, skipped by admission, other
requests go ahead) until `schedule()` polls the compile done. A compile error or timeout
finishes it with FinishReason.ERROR and `invalid_request` (a 400); `drain_finished()` hands
such requests to EngineCore. Then every sequence (an n > 1 request: every child) holds its own
matcher (`req.grammar`); its rows carry the matcher's next-token bitmask and wait for their
result on the host (`needs_host_result`: the mask of step N+1 needs step N's token), and the
matcher accepts every token appended. With a host-side proposer (ngram, radix) a constrained
row drafts too: its drafts are cut at the first one the grammar refuses, and the row carries
one mask per sample (the state after each draft; the matcher is rolled back after reading
them), so a verify position samples exactly what masked decoding would. Draft-model drafts
(made on the device) are not checked: constrained rows do not draft with them. A row whose
matcher terminated (it accepted a stop token) stops with FinishReason.STOP.

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

from radixrt.grammar.spec import grammar_spec
from radixrt.scheduler.request import FinishReason, Request, Status


class GrammarScheduling:
    """Mixin: needs the Scheduler's requests, waiting, stats, _stop, _finish_running,
    _stop_reason."""

    grammar_backend: Any  # GrammarBackend or None (constrained requests are refused)
    jump_forward: bool
    jump_forward_retokenize: bool
    _finished_outside_update: list[Request]

    def _submit_grammar(self, req: Request) -> None:
        """Start compiling `req`'s grammar (it stays grammar-pending). Raises ValueError
        when the request is constrained but no backend is configured."""
        spec = grammar_spec(req.params)
        if spec is None:
            return
        if self.grammar_backend is None:
            raise ValueError(
                f"{spec.field} needs structured output, which this engine does not have "
                "(no grammar backend: install xgrammar)"
            )
        req.grammar_ticket = self.grammar_backend.submit(spec)

    def drain_finished(self) -> list[Request]:
        """Requests finished outside `update` (a grammar that failed to compile, a request
        that failed while being planned) since the last call: they need a last delta."""
        out, self._finished_outside_update = self._finished_outside_update, []
        return out

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a pending compile finishes (returns at once when
        none is pending or the backend cannot wait). For a loop whose step planned nothing."""
        tickets = [r.grammar_ticket for r in self.waiting if r.grammar_ticket is not None]
        wait = getattr(self.grammar_backend, "wait", None)
        if tickets and wait is not None:
            wait(tickets, timeout_s)

    def _poll_grammars(self) -> None:
        """Admit compiled grammars: give each waiting sequence its matcher; fail the requests
        whose compile failed or timed out."""
        for req in [r for r in self.waiting if r.grammar_ticket is not None]:
            outcome = self.grammar_backend.poll(req.grammar_ticket)
            if outcome is None:
                continue
            req.grammar_ticket = None
            if outcome.error is not None:
                self._reject(req, outcome.error, invalid=not outcome.internal)
                continue
            self.stats.num_grammar_requests += 1
            g = req.group
            seqs = [req] if g is None else list(g.children)
            for seq in seqs:
                seq.grammar = self.grammar_backend.new_matcher(outcome.grammar)
                for token in seq.output_token_ids:  # none yet, unless re-added
                    assert seq.grammar.accept(token)
            if g is None and not (self.jump_forward and self._jump_forward(req)):
                self._dead_end(req)  # after forced tokens (the start is checked at compile)

    def _reject(self, req: Request, error: str, invalid: bool) -> None:
        """Finish a waiting request (an n > 1 request: all its children) with ERROR: the
        client's fault (`invalid_request`: a 400) or, not `invalid`, the engine's (a 500)."""
        if invalid:
            self.stats.num_grammar_errors += 1
        else:
            self.stats.num_failed_requests += 1
        g = req.group
        seqs = [req] if g is None else list(g.children)
        for seq in seqs:
            seq.error, seq.invalid_request = error, invalid
        if g is None:
            self._stop(req, FinishReason.ERROR)
        else:
            self.abort(req.rid, FinishReason.ERROR)
        self._finished_outside_update += seqs

    def _fill_masks(self, reqs: list[Request]) -> None:
        """Compute the next masks of these requests' matchers in one batch (if the backend
        can): before planning their rows, and before jump-forward looks at them."""
        matchers = [r.grammar for r in reqs if r.grammar is not None]
        fill = getattr(self.grammar_backend, "fill_masks", None)
        if matchers and fill is not None:
            fill(matchers)

    def _jump_forward_all(self, reqs: list[Request]) -> None:
        """Jump-forward for the running constrained requests that got tokens in `update`;
        then fail those whose grammar allows no next token (`_dead_end`)."""
        reqs = [r for r in reqs if r.grammar is not None and r.status is Status.RUNNING]
        if not reqs:
            return
        self._fill_masks(reqs)
        for req in reqs:
            if self.jump_forward and self._jump_forward(req):
                continue
            if req.status is Status.RUNNING:
                self._dead_end(req)

    def _dead_end(self, req: Request) -> None:
        """Stop `req` with ERROR (the request's fault: a 400) when its grammar allows no
        token now: the grammar's language is empty past this point (`root ::= "a" b` with
        `b ::= b`), and a sample from an all-masked row would be garbage."""
        if req.grammar.is_terminated():
            return
        mask = req.grammar.next_mask()
        if mask.count(0) != len(mask):
            return
        field = grammar_spec(req.params).field
        req.error = (
            f"invalid {field}: no output can match it (no token may follow the "
            f"{req.num_output} output tokens it allowed)"
        )
        req.invalid_request = True
        self.stats.num_grammar_errors += 1
        was_waiting = req.status is Status.WAITING
        self._stop(req, FinishReason.ERROR)
        if was_waiting:
            self._finished_outside_update.append(req)

    @staticmethod
    def _grammar_drafts(req: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar allows (the matcher is left
        as it was)."""
        m, n = req.grammar, 0
        while n < len(drafts) and not m.is_terminated() and m.accept(drafts[n]):
            n += 1
        m.rollback(n)
        return drafts[:n]

    @staticmethod
    def _grammar_masks(req: Request, drafts) -> bytes:
        """The masks of a row's samples, back to back: the current state's, then the state
        after each draft (the matcher is left as it was). The drafts must be allowed
        (`_grammar_drafts`)."""
        m = req.grammar
        masks = [m.next_mask()]
        for token in drafts:
            assert m.accept(token), f"draft {token} is outside {req.rid}'s grammar"
            masks.append(m.next_mask())
        m.rollback(len(drafts))
        return b"".join(masks)

    def _grammar_accept(self, req: Request, token: int) -> FinishReason | None:
        """Feed an appended token to the request's matcher; STOP once it terminated."""
        m = req.grammar
        assert m.accept(token), f"token {token} is outside {req.rid}'s grammar"
        return FinishReason.STOP if m.is_terminated() else None

    def _jump_forward(self, req: Request) -> bool:
        """Append the tokens the grammar forces (see the module docstring); True when that
        finished the request. With `jump_forward_retokenize`, also the tokens of the string
        the grammar forces (xgrammar's own tokenization of it: not output-identical)."""
        m, p = req.grammar, req.params
        queue: list[int] = []
        while req.num_output < req.max_tokens:
            token = queue.pop(0) if queue else m.forced_token()
            if token is None and self.jump_forward_retokenize:
                queue = m.forced_string_tokens()
                token = queue.pop(0) if queue else None
            if token is None:
                return False
            req.seq_token_ids.append(token)
            if p.logprobs:
                req.output_logprobs.append(0.0)
            if p.top_logprobs:
                req.output_top_logprobs.append([(token, 0.0)])
            self.stats.num_generated_tokens += 1
            self.stats.num_forced_tokens += 1
            reason = self._grammar_accept(req, token) or self._stop_reason(req, token)
            if reason is not None:
                was_waiting = req.status is Status.WAITING
                self._stop(req, reason)
                if was_waiting:
                    self._finished_outside_update.append(req)
                return True
        return False

    def _check_grammar_integrity(self) -> None:
        for req in self.requests.values():
            if req.grammar is not None:
                assert req.grammar_ticket is None
                assert req.grammar.num_accepted == req.num_output, (
                    f"{req.rid}: matcher saw {req.grammar.num_accepted} tokens, "
                    f"the request has {req.num_output}"
                )
