"""Applying an executed plan's result: the `Scheduler`'s after-the-step half (a mixin).

`update(plan, result)` appends each row's accepted tokens (1..k+1 with speculation; stopping at
a stop condition inside them), rolls back rejected drafts' KV, inserts what was computed into
the prefix cache, finishes requests and frees their KV; `fail_step` and `_fail` fail a step's or
one request's work without touching other requests (a group fails as a whole). Results of
rows whose request was aborted, finished or preempted since the plan was made (another epoch)
are ignored. `check_integrity` checks the scheduler's, allocator's and cache's accounting
together. Plain Python, no torch.
"""

from __future__ import annotations

import logging
import math

from radixrt.cache.tiers import unmade_blocks
from radixrt.plan import CopyBlock, PlanRow, StepPlan, StepResult, SwapIn, SwapOut
from radixrt.scheduler.request import FinishReason, ForkGroup, Request, Status

logger = logging.getLogger("radixrt.scheduler.scheduler")


class ResultApplication:
    """Mixin of `Scheduler`: it uses the scheduler's queues, allocator, cache and stats."""

    # ---- after the step ----
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply an executed plan's result (plans are applied in the order they were
        made). Returns the requests that got tokens or finished."""
        launched = self._launched.pop(plan.step_id)
        assert result.step_id == plan.step_id
        changed: list[Request] = []
        beam_groups: dict[int, ForkGroup] = {}
        for i, (row, req, epoch) in enumerate(zip(plan.rows, launched.requests, launched.epochs)):
            if req.epoch != epoch or req.status is not Status.RUNNING:
                self.stats.num_dropped_tokens += len(result.tokens[i])
                continue  # finished, aborted or preempted since the plan was made
            try:
                self._apply_row(req, row, result, i, changed, beam_groups)
            except Exception as e:  # a bug in one request's bookkeeping fails it (its group)
                changed += self._fail(req, e)
        for g in beam_groups.values():
            if g.parent.status is Status.FORKED and all(
                b.beam_top_logprobs is not None for b in g.children
            ):
                self._beam_step(g, changed)
        if self.grammar_backend is not None:
            self._jump_forward_all(changed)
        return changed

    def fail_step(self, plan: StepPlan, error: str) -> list[Request]:
        """The plan's execution failed: finish every request still in it (same incarnation)
        with FinishReason.ERROR. With host-tier swap ops in it, none of its block ops counts as
        done (`_discard_unmade_copies`). Returns the failed requests."""
        launched = self._launched.pop(plan.step_id)
        self.stats.num_failed_steps += 1
        failed = []
        for req, epoch in zip(launched.requests, launched.epochs):
            if req.epoch == epoch and req.status is Status.RUNNING:
                failed += self._fail(req, error)
        if any(isinstance(op, SwapIn | SwapOut) for op in plan.block_ops):
            self._discard_unmade_copies(plan)
        return failed

    def _discard_unmade_copies(self, plan: StepPlan) -> None:
        """The failed plan may have run none, some or all of its block ops: the blocks they
        write, and what later plans (and ops queued since) copied from those, hold unknown
        content. Requests holding such a device block or locking a node that loses a copy
        are preempted (they recompute, or load again from a valid host copy); then the cache
        forgets those copies, so no node claims KV that may never have been copied."""
        later = [self._launched[i].block_ops for i in sorted(self._launched) if i > plan.step_id]
        host = self.cache.host
        later.append(self._pending_ops + host.pending_ops)  # they run next, in this order
        device_blocks, host_blocks = unmade_blocks(plan.block_ops, later)
        stale = {id(n) for n in self.cache.stale_nodes(device_blocks, host_blocks)}
        for req in list(self.running):
            if req.status is Status.RUNNING and (
                not device_blocks.isdisjoint(req.block_table) or _on_path(req.cache_handle, stale)
            ):
                self._preempt(req)
        self.cache.discard_copies(device_blocks, host_blocks)
        host.uncount(plan.block_ops)

    def _fail(self, req: Request, error: Exception | str) -> list[Request]:
        """Finish `req` with FinishReason.ERROR, releasing what it holds; a member of a
        group (n > 1, beam search) fails its whole group (`_fail_group`). Returns the
        finished requests that report (get a delta)."""
        if req.group is not None:
            return self._fail_group(req, error)
        self._fail_one(req, error)
        return [req]

    def _fail_one(self, req: Request, error: Exception | str) -> None:
        """Finish `req` with FinishReason.ERROR, releasing what it holds."""
        if isinstance(error, Exception):
            logger.error("request %s failed", req.rid, exc_info=error)
            error = f"internal error: {type(error).__name__}: {error}"
        req.error = error
        self.stats.num_failed_requests += 1
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        try:
            self._finish(req, FinishReason.ERROR)
        except Exception:  # its state is broken: drop it without caching anything
            logger.exception("releasing failed request %s", req.rid)
            req.num_kv_done = 0
            self.requests.pop(req.rid, None)
            if req.group is not None and req in req.group.children:
                req.group.children.remove(req)
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR

    def _apply_row(
        self,
        req: Request,
        row: PlanRow,
        result: StepResult,
        i: int,
        changed: list[Request],
        beam_groups: dict[int, ForkGroup],
    ) -> None:
        """Apply row i of a result to its (still running) request (a beam's row is collected
        in `beam_groups`: its group picks the next beams once all its rows are in)."""
        if row.needs_host_result:
            req.awaiting_host_result = False
        if row.prompt_logprobs is not None:
            req.prompt_logprobs += result.prompt_logprobs[i]
        req.num_kv_done = max(req.num_kv_done, row.end)
        if not row.sample_offsets:
            if req.max_tokens == 0 and row.end == len(req.seq_token_ids):
                if req.group is not None and req is req.group.parent:  # fork next schedule()
                    self._cache_progress(req, row.end)
                    req.group.ready = True
                    return
                changed.append(req)  # prefill-only (scoring / cache warming): done
                self._finish_running(req, FinishReason.LENGTH)
            else:  # a prefill chunk: share its progress with others at once
                self._cache_progress(req, row.end)
            return
        # a last prefill chunk (a verify row feeds k + 1 tokens but is a decode row)
        if row.num_tokens - row.num_draft_tokens > 1 or row.start < req.prompt_len:
            self._cache_progress(req, row.end)
        if not req.reports:  # a beam: its group picks the next beams (see update)
            req.num_inflight_samples -= 1
            req.beam_top_logprobs = result.top_logprobs[i][0]
            beam_groups[id(req.group)] = req.group
            return
        changed.append(req)
        self._accept(req, row, result, i)

    def _accept(self, req: Request, row: PlanRow, result: StepResult, i: int) -> None:
        """Append the row's accepted tokens, stopping at the first stop condition."""
        tokens = result.tokens[i]
        req.num_inflight_samples -= 1
        if row.num_draft_tokens:
            # Drafts past the accepted ones were fed with wrong KV: roll back to the
            # accepted length (the KV of the last accepted token is computed next step).
            req.num_computed = req.num_kv_done = row.start + len(tokens)
            self._truncate(req)
            self.stats.spec.record_verify(row.num_draft_tokens, len(tokens) - 1)
            req.num_draft_tokens += row.num_draft_tokens
            req.num_accepted_tokens += len(tokens) - 1
        p = req.params
        for j, token in enumerate(tokens):
            req.seq_token_ids.append(token)
            if p.logprobs:
                req.output_logprobs.append(result.logprobs[i][j])
            if p.top_logprobs:
                req.output_top_logprobs.append(result.top_logprobs[i][j])
            self.stats.num_generated_tokens += 1
            reason = self._stop_reason(req, token)
            if req.grammar is not None:
                reason = self._grammar_accept(req, token) or reason
            if reason is not None:
                self.stats.num_dropped_tokens += len(tokens) - j - 1
                self._finish_running(req, reason)
                return

    def _truncate(self, req: Request) -> None:
        """Free blocks past the request's computed KV (speculative rollback)."""
        keep = math.ceil(req.num_computed / self.block_size)
        if keep < len(req.block_table):
            self._free(req.block_table[keep:])
            del req.block_table[keep:]
            req.num_table_sent = min(req.num_table_sent, keep)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if req.num_output >= req.max_tokens or len(req.seq_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _cache_progress(self, req: Request, end: int) -> None:
        """Insert the first `end` computed tokens so others can share them."""
        result = self.cache.insert(req.seq_token_ids[:end], req.block_table)
        self.cache.lock(result.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = result.handle

    def _finish_running(self, req: Request, reason: FinishReason) -> None:
        self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        # Only KV that executed steps wrote is cached (a step in flight may still write).
        done = min(req.num_kv_done, len(req.seq_token_ids))
        if done:
            self.cache.insert(req.seq_token_ids[:done], req.block_table)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        g = req.group
        if g is not None and req is not g.parent:
            g.children.remove(req)
            if not req.reports:
                return  # a beam
        if req.reports:
            self.stats.finish_reasons[reason.value] += 1
        del self.requests[req.rid]
        if g is not None and g.beam is None and not g.children and req is not g.parent:
            self._stop(g.parent, reason)  # the last child of an n > 1 request

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Every block reference is accounted for: the cache's plus the requests'."""
        refs = self.cache.held_refs()
        for req in self.running:
            refs.update(req.block_table)
            assert len(req.block_table) >= math.ceil(req.num_computed / self.block_size)
            assert req.slot is not None and 0 <= req.num_inflight_samples <= 1
        groups = {id(r.group): r.group for r in self.requests.values() if r.group is not None}
        idle = list(self.waiting)
        for g in groups.values():
            assert g.parent.status is not Status.FINISHED
            assert all(c.group is g and c.status is not Status.FINISHED for c in g.children)
            assert g.beam is None or len(g.children) <= g.beam.width
            idle += [c for c in g.children if c.status is Status.WAITING]
            if g.parent.status is Status.FORKED:
                idle.append(g.parent)
                assert not g.ready and g.children
            elif g.parent.status is Status.WAITING:
                assert not g.reserved_slots and not g.ready
                assert all(c.status is Status.WAITING for c in g.children)
        for req in idle:
            assert not req.block_table and req.cache_handle is None and req.slot is None
        slots = [r.slot for r in self.running]
        slots += [s for g in groups.values() for s in g.reserved_slots]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots)
        assert len(slots) + len(self._free_slots) == self.num_slots, "slot leaked"
        self.allocator.check_integrity(refs)
        self.cache.check_integrity()
        self._check_grammar_integrity()
        in_use = {b for r in self.running for b in r.block_table}
        for op in self._pending_ops:  # a copy into a freed block would clobber its next use
            assert not isinstance(op, CopyBlock) or op.dst in in_use, f"{op} into a free block"
        cached_only = set(self.cache.held_refs()) - in_use
        assert len(cached_only) <= self.cache.cached_blocks
        free, num_in_use, num_cached = self.allocator.num_free, len(in_use), len(cached_only)
        assert free + num_cached + num_in_use == self.allocator.num_blocks, (
            f"free {free} + cached {num_cached} + in use {num_in_use} "
            f"!= total {self.allocator.num_blocks}"
        )


def _on_path(handle, nodes: set[int]) -> bool:
    """Whether a node of the radix path root..handle is in `nodes` (ids)."""
    while handle is not None:
        if id(handle) in nodes:
            return True
        handle = handle.parent
    return False
