"""How requests leave the running set: finish, stop, fail, preempt (plain Python).

A request finishes by caching what executed steps computed and releasing its KV; a group (n > 1
children, beam search) is preempted, aborted and failed as a whole: its children leave holding
nothing and its parent is requeued (preemption) or finished with them. Requests finished
outside `Scheduler.update` (a failed compile, a failure while planning) are reported here
(`report`, `fail_outside_update`) until the engine drains them for their last delta. The
features' `on_preempt` / `on_finish` hooks hear of each sequence preempted and each request
finished.
"""

from __future__ import annotations

import logging

from radixrt.deltas import FinishReason
from radixrt.scheduler.features import Hooks
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.queues import RequestQueues, is_queued
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.stats import SchedulerCounters

logger = logging.getLogger("radixrt.scheduler.scheduler")


class Lifecycle:
    def __init__(
        self,
        kv: KVManager,
        queues: RequestQueues,
        stats: SchedulerCounters,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        hooks: Hooks,
    ) -> None:
        """`hooks`: the features' (their `on_preempt` / `on_finish` lists are read here)."""
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._finished_outside_update: list[Request] = []
        self.on_preempt = hooks.on_preempt
        self.on_finish = hooks.on_finish

    def stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """Why `req` stops after its newest output token `token` (already appended), if it
        does: an EOS or stop token id, max_tokens, the context length."""
        p = req.params
        stops = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stops and req.num_output >= p.min_tokens:  # the runner masks them before that
            return FinishReason.STOP
        if req.num_output >= req.max_tokens or len(req.seq_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def report(self, *reqs: Request) -> None:
        """`reqs` finished outside `Scheduler.update`: the engine gives them a last delta."""
        self._finished_outside_update.extend(reqs)

    def fail_outside_update(self, req: Request, error: Exception | str) -> None:
        """`fail` outside `Scheduler.update`, reporting the failed requests."""
        self.report(*self.fail(req, error))

    def drain_finished(self) -> list[Request]:
        """Requests finished outside `update` since the last call (they need a last delta)."""
        out, self._finished_outside_update = self._finished_outside_update, []
        return out

    # ---- finishing ----
    def abort(self, rid: str, reason: FinishReason) -> Request | None:
        """Stop request `rid` now (a group parent: the whole group) and free its KV; computed
        tokens stay in the prefix cache. Returns the finished request, or None if `rid` is
        unknown or already finished."""
        req = self.queues.requests.get(rid)
        if req is None:
            return None
        g = req.group
        if g is not None and req is g.parent:
            # the whole group: every child (an n > 1 parent finishes with its last child)
            for child in list(g.children):
                self.stop(child, reason)
            if req.status is not RequestStatus.FINISHED:
                self.stop(req, reason)
            return req
        self.stop(req, reason)
        return req

    def stop(self, req: Request, reason: FinishReason) -> None:
        """Finish `req` whatever its status (waiting, running, forked)."""
        q = self.queues
        if req.status is RequestStatus.WAITING:
            if is_queued(req):
                q.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            q.running.remove(req)
        self.finish(req, reason)

    def finish_running(self, req: Request, reason: FinishReason) -> None:
        self.queues.running.remove(req)
        self.finish(req, reason)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Cache what executed steps computed (a step in flight may still write), release
        the KV, record the reason; the last child of an n > 1 request finishes its parent."""
        self.kv.cache_finished(req)
        self.kv.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        for hook in self.on_finish:
            hook(req)
        g = req.group
        if g is not None and req is not g.parent:
            g.children.remove(req)
            if not req.reports:
                return  # a beam
        del self.queues.requests[req.rid]
        if g is not None and g.beam is None and not g.children and req is not g.parent:
            self.stop(g.parent, reason)  # the last child of an n > 1 request

    # ---- failing ----
    def fail(self, req: Request, error: Exception | str) -> list[Request]:
        """Finish `req` with FinishReason.ERROR, releasing what it holds; a member of a
        group (n > 1, beam search) fails its whole group. Returns the finished requests that
        report (get a delta)."""
        g = req.group
        if g is None:
            self.fail_one(req, error)
            return [req]
        failed = []
        for member in [*g.children, g.parent]:  # the last n > 1 child finishes the parent
            if member.status is not RequestStatus.FINISHED:
                self.fail_one(member, error)
                if member.reports:
                    failed.append(member)
        return failed

    def fail_one(self, req: Request, error: Exception | str) -> None:
        """Finish `req` with FinishReason.ERROR, releasing what it holds; counted in
        `num_failed_requests` when it reports (a request, an n > 1 child, a beam search; not
        the beams or an n > 1 parent inside a group)."""
        q = self.queues
        if isinstance(error, Exception):
            logger.error("request %s failed", req.rid, exc_info=error)
            error = f"internal error: {type(error).__name__}: {error}"
        req.error = error
        if req.reports:
            self.stats.failed_requests += 1
        if req.status is RequestStatus.RUNNING:
            if req in q.running:  # a failure half-way through moving it may have left it
                q.running.remove(req)
        elif req in q.waiting:
            q.waiting.remove(req)
        try:
            self.finish(req, FinishReason.ERROR)
        except Exception:  # its state is broken: drop it without caching anything
            logger.exception("releasing failed request %s", req.rid)
            req.num_kv_done = 0
            q.requests.pop(req.rid, None)
            if req.group is not None and req in req.group.children:
                req.group.children.remove(req)
            req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
            for hook in self.on_finish:
                hook(req)

    # ---- preempting ----
    def preempt(self, req: Request) -> None:
        """Free the request's KV and put it at the head of the waiting queue (it will be
        recomputed, reusing whatever the prefix cache still holds). A group member takes its
        whole group: the children leave (holding nothing), the parent is requeued and forks
        them again once it recomputed the shared prefix."""
        g = req.group
        if g is not None:
            for child in g.children:
                if child.status is RequestStatus.RUNNING:
                    self._unrun(child)
            g.ready = False
            req = g.parent
        self._unrun(req)
        self.stats.preemptions += 1
        self.queues.waiting.appendleft(req)

    def preempt_newest(self, exclude: list[Request]) -> None:
        """Preempt the latest admitted running sequence not in `exclude` (with its group)."""
        self.preempt(self.queues.newest_running(exclude))

    def _unrun(self, seq: Request) -> None:
        """Preemption of one sequence: out of `running`, its KV freed, a new epoch (results of
        steps in flight for it are ignored), waiting again."""
        if seq.status is RequestStatus.RUNNING:
            self.queues.running.remove(seq)
        self.kv.release(seq)
        seq.epoch += 1
        seq.status = RequestStatus.WAITING
        seq.num_preemptions += 1
        for hook in self.on_preempt:
            hook(seq)
