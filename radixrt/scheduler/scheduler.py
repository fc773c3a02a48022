"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One step: `plan = scheduler.schedule()`, a runner executes it, `scheduler.update(plan,
result)`. The scheduler is plain Python: it holds no tensors and never touches KV memory;
copy-on-write is a block operation in the plan. Decode rows are scheduled first (one
token each); the rest of the token budget goes to prefill chunks, continuing ones first,
then waiting requests in policy order.

Overlap: `schedule()` may run while earlier plans are still executing (their results not
applied). A row sampled by a step in flight counts as one more token (`num_inflight_samples`)
whose value the next decode step reads on the device; stop conditions are checked when the
result arrives, and a request found finished then has the extra step's token dropped. A request
that is aborted, finished or preempted while in flight frees its KV at once; results of that
step for it are ignored. Freed blocks are reused only by later plans, which a runner executes
after the earlier ones (one stream), so no step reads a block after another reused it.

Speculation (`proposer`, see `radixrt.spec`): a decode row with k drafts reserves blocks for
k + 1 tokens and samples at each; `update` appends the accepted tokens (stopping at a stop
condition inside them), rolls num_computed back to the accepted length and frees blocks past
it in the same step, so only accepted tokens ever reach the prefix cache. Such rows wait for
their result on the host (the proposer reads the sequence), so they do not overlap.
Structured output (`grammar_backend`): constrained requests wait while their grammar compiles,
their rows carry token bitmasks and wait for their result on the host; tokens the grammar
forces are appended without sampling (jump-forward); see `radixrt.grammar.scheduling`.
Groups (n > 1 children, beam search) share a prompt's blocks by reference and are admitted
(with all their slots), preempted and aborted as a whole; see `radixrt.scheduler.groups`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixrt.cache.base import MatchResult, PrefixCache
from radixrt.config import SchedulerConfig
from radixrt.grammar.scheduling import GrammarScheduling
from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import (
    CopyBlock,
    PlanRow,
    PromptLogprobs,
    StepPlan,
    SwapIn,
    SwapOut,
)
from radixrt.scheduler.groups import GroupScheduling
from radixrt.scheduler.policy import IN_BATCH_PREFIX_THRESHOLD, common_prefix_len, order_waiting
from radixrt.scheduler.request import FinishReason, Request, Status
from radixrt.scheduler.results import ResultApplication
from radixrt.spec.base import Proposer, SpecStats

logger = logging.getLogger(__name__)

# Scanning the waiting queue past this many held-back requests stops for the step (each
# check costs a prefix match).
MAX_DEFERRED_PER_STEP = 64


@dataclass
class SchedulerStats:
    num_requests: int = 0  # admitted for the first time
    num_prompt_tokens: int = 0  # prompt tokens of those
    num_cached_tokens: int = 0  # of those, served by the prefix cache
    num_generated_tokens: int = 0
    num_dropped_tokens: int = 0  # sampled by an overlapped step after the request finished
    num_preemptions: int = 0
    num_cow_copies: int = 0  # partial blocks copied on a mid-block match
    num_inplace_appends: int = 0  # mid-block matches that could write on in the cached block
    num_steps: int = 0
    num_failed_requests: int = 0  # finished with FinishReason.ERROR (each one is a bug)
    num_failed_steps: int = 0  # plans whose execution raised
    num_prompt_tokens_computed: int = 0  # prompt positions fed to the model (recomputes too)
    num_host_hit_tokens: int = 0  # of num_cached_tokens, loaded from the host KV tier
    num_deferred_loads: int = 0  # admissions whose first row waited a step for host loads
    num_forks: int = 0  # n > 1 / beam-search groups forked (again after a preemption)
    num_fork_shared_blocks: int = 0  # full blocks children took a reference on at a fork
    num_fork_copied_blocks: int = 0  # partial blocks copied for children at a fork
    num_beam_shared_blocks: int = 0  # full blocks a re-parented beam took references on
    num_beam_copied_blocks: int = 0  # partial blocks copied for re-parented beams
    num_beam_steps: int = 0  # beam selections (one per group and generated token)
    num_grammar_requests: int = 0  # constrained requests whose grammar compiled
    num_grammar_errors: int = 0  # constrained requests refused (compile error or timeout)
    num_forced_tokens: int = 0  # tokens appended by jump-forward (also in generated)
    finish_reasons: Counter = field(default_factory=Counter)
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass
class _Launched:
    """Scheduler-side record of a plan in flight: which request (and incarnation) each row
    belongs to."""

    requests: list[Request]
    epochs: list[int]
    block_ops: list  # the plan's (a failed earlier plan may have left them wrong inputs)


class Scheduler(GroupScheduling, GrammarScheduling, ResultApplication):
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: BlockAllocator,
        cache: PrefixCache,
        *,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        proposer: Proposer | None = None,
        grammar_backend: object | None = None,
        jump_forward: bool = True,
        jump_forward_retokenize: bool = False,
    ) -> None:
        """`proposer` (speculative decoding) drafts tokens for decode rows; a row with
        drafts feeds its last token plus the drafts and samples at each (k + 1 tokens), and
        waits for that result on the host before its next step. `grammar_backend`
        (radixrt.grammar.base.GrammarBackend) serves constrained requests, with
        `jump_forward` and `jump_forward_retokenize` (see radixrt.grammar.scheduling)."""
        self.cfg = cfg
        self.grammar_backend = grammar_backend
        self.jump_forward = jump_forward
        self.jump_forward_retokenize = jump_forward_retokenize
        self._finished_outside_update: list[Request] = []
        self.proposer = proposer
        self.allocator = allocator
        self.cache = cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Runner row slots: one per running request (max_running_requests of them).
        self.num_slots = cfg.max_running_requests
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.stats = SchedulerStats()
        self._admissions = 0
        self._step_ids = itertools.count()
        self._launched: dict[int, _Launched] = {}
        # This step's prefix matches of waiting requests (valid while cache.version holds).
        self._matches: dict[Request, MatchResult] = {}
        self._matches_version = -1
        # Block ops made while applying a result (beam re-parenting) for the next plan.
        self._pending_ops: list = []
        # Swap ops the cache queued (host KV tier; only the radix cache has one).
        self._take_swap_ops = getattr(cache, "take_swap_ops", list)

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit."""
        self._check_fits(req, 1, "")
        self._submit_grammar(req)
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Stop a request now (client gone, or a stop string seen: reason STOP) and free
        its KV; computed tokens stay in the prefix cache. Safe while a step holding the
        request is in flight (its results for the request are dropped). Returns the
        finished request, or None if `rid` is unknown or already finished."""
        req = self.requests.get(rid)
        if req is None:
            return None
        g = req.group
        if g is not None and req is g.parent:
            # the whole group: every child (an n > 1 parent finishes with its last child)
            for child in list(g.children):
                self._stop(child, reason)
            if req.status is not Status.FINISHED:
                self._stop(req, reason)
            return req
        self._stop(req, reason)
        return req

    def _stop(self, req: Request, reason: FinishReason) -> None:
        if req.status is Status.WAITING:
            if _queued(req):
                self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        self._finish(req, reason)

    @property
    def has_work(self) -> bool:
        """Requests waiting or running (results of steps in flight may still be due)."""
        return bool(self.waiting or self.running)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._launched)

    # ---- scheduling ----
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no row can run now. Mutates request and cache
        state (blocks, locks, slots); the plan counts as in flight until `update`."""
        self._matches.clear()
        ops: list = self._pending_ops
        self._pending_ops = []
        if self.grammar_backend is not None:
            self._poll_grammars()
        for parent in [r for r in self.running if r.group is not None and r.group.ready]:
            assert parent is parent.group.parent
            self._fork(parent.group, ops)
        decode = self._schedule_decode()
        budget = self.cfg.max_num_batched_tokens - sum(1 + len(d) for _, d in decode)
        extend: list[tuple[Request, int]] = []
        for req in [r for r in self.running if self._schedulable(r) and self._extend_due(r)]:
            n = self._chunk(req, budget)
            if n == 0 or req.status is not Status.RUNNING:
                break
            if not self._reserve(req, n) and not (
                not decode and not extend and self._preempt_until_reserved(req, n)
            ):
                break
            extend.append((req, n))
            budget -= n
        if budget > 0 and self.waiting:
            budget = self._admit(budget, extend, ops)
        for req in self.waiting:
            req.waited_steps += 1
        if not decode and not extend:
            # No row: copies into blocks a running request holds (a fork parent's whole
            # prefix cached) wait for the next plan; the others were for forks or beams
            # preempted since (their blocks are free now, nothing to copy).
            held = {b for r in self.running for b in r.block_table}
            self._pending_ops = self._swaps_first(
                [op for op in ops if not isinstance(op, CopyBlock) or op.dst in held]
            )
            return None
        step_id = next(self._step_ids)
        # one-token rows first (the decode kernel), then rows with drafts, then prefill chunks
        ordered = [(r, d) for r, d in decode if not d] + [(r, d) for r, d in decode if d]
        if self.grammar_backend is not None:
            self._fill_masks([r for r, _ in decode] + [r for r, _ in extend])
        rows, reqs, failed = [], [], False
        for req, n, drafts in [(r, 1 + len(d), d) for r, d in ordered] + [
            (r, n, ()) for r, n in extend
        ]:
            try:
                rows.append(self._plan_row(req, n, drafts))
            except Exception as e:  # a bug planning one request fails that request only
                self._finished_outside_update += self._fail(req, e)
                failed = True
                continue
            reqs.append(req)
        if failed:  # rows of a failed group's other members go too
            kept = [i for i, r in enumerate(reqs) if r.status is Status.RUNNING]
            rows, reqs = [rows[i] for i in kept], [reqs[i] for i in kept]
        if not rows:
            self._pending_ops = [op for op in self._swaps_first(ops) if _is_swap(op)]
            return None
        ops = self._swaps_first(ops)
        self._launched[step_id] = _Launched(reqs, [r.epoch for r in reqs], ops)
        self.stats.num_steps += 1
        return StepPlan(step_id, rows, ops)

    def _swaps_first(self, ops: list) -> list:
        """`ops` with the host tier's swap ops (earlier pending ones, then those the cache
        made since) first, then the copies. Swaps never touch a copy's blocks (a copy reads
        a locked block and writes a fresh one), so running them first is safe, and the
        runner can start every transfer before the step's device work."""
        swaps = [op for op in ops if _is_swap(op)] + self._take_swap_ops()
        return swaps + [op for op in ops if not _is_swap(op)]

    def _schedulable(self, req: Request) -> bool:
        """Running and not waiting for the host result of a step in flight."""
        return req.status is Status.RUNNING and not req.awaiting_host_result

    @staticmethod
    def _extend_due(req: Request) -> bool:
        """More than one token to feed (a prefill chunk), or a prompt-only request's last."""
        return req.num_pending > 1 or (req.max_tokens == 0 and req.num_pending == 1)

    def _decode_due(self, req: Request) -> bool:
        """One token to feed, and the sample it makes may still be kept (a request whose
        in-flight samples already reach max_tokens or the context waits for them)."""
        return (
            req.num_pending == 1
            and req.num_output + req.num_inflight_samples < req.max_tokens
            and req.seq_len < self.max_model_len
        )

    def _schedule_decode(self) -> list[tuple[Request, list[int]]]:
        """Decode rows and their drafts ([] without speculation)."""
        scheduled: list[tuple[Request, list[int]]] = []
        due = [
            r
            for r in sorted(self.running, key=lambda r: r.admission_seq)
            if self._schedulable(r) and self._decode_due(r)
        ]
        # drafts take what the token budget leaves after one token for every decode row
        spare = self.cfg.max_num_batched_tokens - len(due)
        for req in due:
            if req.status is not Status.RUNNING:
                continue  # preempted for an earlier row's blocks
            drafts = self._drafts(req, spare)
            spare -= len(drafts)
            while not self._reserve(req, 1 + len(drafts)):
                victim = self._newest_preemptible(exclude=[r for r, _ in scheduled])
                self._preempt(victim)
                # a group goes as a whole, rows already picked for it too
                scheduled = [(r, d) for r, d in scheduled if r.status is Status.RUNNING]
                if req.status is not Status.RUNNING:
                    break
            else:
                scheduled.append((req, drafts))
        return scheduled

    def _drafts(self, req: Request, spare: int) -> list[int]:
        """Draft tokens for a decode row: only with a proposer, the row's last token on the
        host, and room for them (max_tokens, the context and `spare` tokens of the step's
        budget). Beams never draft (their group picks one token per beam from top
        log-probs). Rows with penalties draft: the runner penalises each position with the
        drafts before it counted (`radixrt.engine.spec_penalties`)."""
        if self.proposer is None or req.num_inflight_samples:
            return []
        if req.grammar is not None and getattr(self.proposer, "drafts_on_device", False):
            return []  # device drafts cannot be checked against the grammar
        if not req.reports:
            return []
        room = min(
            req.max_tokens - req.num_output - 1,
            self.max_model_len - len(req.seq_token_ids) - 1,
            spare,
        )
        k = min(self.cfg.num_speculative_tokens, room)
        if k <= 0:
            return []
        drafts = self.proposer.propose(req, k)[:k]
        if req.grammar is not None and drafts:
            drafts = self._grammar_drafts(req, drafts)
        self.stats.spec.num_proposals += 1
        self.stats.spec.num_proposals_with_drafts += bool(drafts)
        return drafts

    def _preempt_until_reserved(self, req: Request, n: int) -> bool:
        """Nothing else runs this step and `req` (a running request with a chunk to feed,
        e.g. a jump-forward run) lacks blocks: preempt the newest other requests until it
        has them, so that running chunks cannot all wait on each other's blocks. False when
        `req` itself went (its group was the newest) or nothing else can go."""
        while not self._reserve(req, n):
            if len(self.running) < 2:
                return False
            self._preempt(self._newest_preemptible(exclude=[req]))
            if req.status is not Status.RUNNING:
                return False
        return True

    def _newest_preemptible(self, exclude: list[Request]) -> Request:
        taken = set(map(id, exclude))
        candidates = [r for r in self.running if id(r) not in taken]
        assert candidates, "a request needing a block is always preemptible itself"
        return max(candidates, key=lambda r: r.admission_seq)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_pending, budget)
        if self.cfg.long_prefill_token_threshold:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return max(n, 0)

    def _match(self, req: Request) -> MatchResult:
        """The request's cached prefix this step: matched once, again only if the cache
        evicted something since (which may invalidate the earlier result)."""
        if self._matches_version != self.cache.version:
            self._matches.clear()
            self._matches_version = self.cache.version
        m = self._matches.get(req)
        if m is None:
            m = self._matches[req] = self.cache.match(req.seq_token_ids[: self._match_limit(req)])
        return m

    @staticmethod
    def _match_limit(req: Request) -> int:
        # The last token is always recomputed (its logits are sampled), but by a fork
        # parent (it samples nothing); with prompt log-probs, so is every token from
        # logprob_start_len - 1 on.
        limit = len(req.seq_token_ids) - (0 if req.group is not None else 1)
        if req.params.prompt_logprobs:
            limit = min(limit, req.params.logprob_start_len - 1)
        return limit

    def _admit(self, budget: int, extend: list[tuple[Request, int]], ops: list) -> int:
        order = order_waiting(
            self.waiting, self.cfg.policy, self._match, self.cfg.aging_tokens_per_step
        )
        # Cache-aware policies hold back a request whose uncached prefix another request is
        # computing right now: next step it finds that prefix in the cache instead.
        computing = [r for r in self.running if r.num_pending > 1]
        dedup = self.cfg.policy != "fcfs"
        skipped = 0
        for req in order:
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            group_slots = req.group.num_slots if req.group is not None else 1
            if group_slots > len(self._free_slots):
                break
            if req.grammar_ticket is not None:  # grammar-pending: its compile runs
                continue
            if dedup and computing and self._shares_uncached_prefix(req, computing):
                skipped += 1
                if skipped >= MAX_DEFERRED_PER_STEP:
                    break
                continue
            n = self._try_start(req, ops, budget)
            if n is None:
                break
            if req.group is not None:
                req.group.reserved_slots = [self._free_slots.pop() for _ in range(group_slots - 1)]
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed
                self.stats.num_host_hit_tokens += req.num_host_cached_tokens
                # a group's parent holds the prompt but its last token
                prompt_len = req.prompt_len + (1 if req.group is not None else 0)
                self.stats.num_requests += 1
                self.stats.num_prompt_tokens += prompt_len
                self.stats.num_cached_tokens += req.num_computed
                self.cache.stats.record_lookup(prompt_len, req.num_computed)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self._admissions += 1
            req.admission_seq = self._admissions
            self.running.append(req)
            if n == 0:  # a fork parent with its whole prefix cached
                req.group.ready = True
                continue
            if req.num_host_cached_tokens and (extend or budget < self.cfg.max_num_batched_tokens):
                # Its blocks load from the host tier in this step (SwapIn ops): its first row
                # comes with the next plan, so this step's other rows need not wait for the
                # transfer (see radixrt.kv.host_pool).
                self.stats.num_deferred_loads += 1
                continue
            extend.append((req, n))
            computing.append(req)
            budget -= n
        return budget

    def _try_start(self, req: Request, ops: list, budget: int) -> int | None:
        """Start `req` and reserve its first chunk; returns the chunk, or None holding nothing.
        When nothing else runs and its locked cached path (with the blocks of every branch on
        it, which a host tier keeps and loads) leaves too few blocks, retry with shorter
        cached prefixes (the path's node boundaries, then none): otherwise the request could
        never run."""
        shorter: list[int] | None = None
        while True:
            num_ops = len(ops)
            if self._start(req, ops):
                n = self._chunk(req, budget)
                if self._reserve(req, n) and (not shorter or self._can_finish(req)):
                    return n
                del ops[num_ops:]
                self._release(req)
            if self.running:
                return None
            if shorter is None:
                m = self._match(req)
                if m.num_cached_tokens == 0:
                    return None
                node, shorter = m.handle, [0]
                while getattr(node, "parent", None) is not None:  # radix: node boundaries
                    shorter.insert(1, node.start)
                    node = node.parent
                shorter = sorted(set(shorter) - {m.num_cached_tokens})
            if not shorter:
                return None
            self._match(req)  # brings the per-step match table up to the cache version
            self._matches[req] = self.cache.match(req.seq_token_ids[: shorter.pop()])

    def _can_finish(self, req: Request) -> bool:
        """Whether the blocks free or evictable now cover the rest of `req` (all its tokens to
        come), so that a retry with a shorter prefix does not just preempt it again."""
        total = math.ceil(
            (len(req.seq_token_ids) + req.max_tokens - req.num_output) / self.block_size
        )
        return self.allocator.num_free + self.cache.evictable_blocks >= total - len(req.block_table)

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        cached = self._match(req).num_cached_tokens
        return any(
            common_prefix_len(req.seq_token_ids, other.seq_token_ids) - cached
            >= IN_BATCH_PREFIX_THRESHOLD
            for other in computing
        )

    def _start(self, req: Request, ops: list) -> bool:
        """Lock the cached prefix and take its blocks (a partial last block is written on in
        place when nothing else can see past its matched tokens, else copied: a CopyBlock
        op). Returns False, holding nothing, when blocks are short."""
        bs = self.block_size
        m = self._match(req)
        self.cache.lock(m.handle)
        req.cache_handle = m.handle
        req.slot = self._free_slots.pop()
        req.num_host_cached_tokens = m.num_host_tokens
        if m.num_host_tokens:  # host tier: load the host-resident tail of the match
            table = self.cache.load(m.handle)
            if table is None:
                self._release(req)
                return False
            m = m._replace(blocks=table, num_host_tokens=0)
        req.num_table_sent = 0
        if req.params.prompt_logprobs:
            req.prompt_logprobs = []
        full, partial = divmod(m.num_cached_tokens, bs)
        shared = m.blocks[:full]
        self.allocator.incref(shared)
        req.block_table = list(shared)
        if partial:
            last = m.blocks[full]
            if self.allocator.ref_counts[last] == 1:
                # Only the cache node that ends the match records this block (a second
                # node, e.g. after a split, or any request would hold another reference),
                # so nothing lives past the matched tokens: append in place, no copy.
                self.allocator.incref([last])
                req.block_table.append(last)
                self.stats.num_inplace_appends += 1
            else:
                copy = self._allocate(1)
                if copy is None:
                    self._release(req)
                    return False
                ops.append(CopyBlock(last, copy[0], partial))
                self.stats.num_cow_copies += 1
                req.block_table += copy
        req.num_computed = req.num_kv_done = m.num_cached_tokens
        return True

    def _allocate(self, n: int) -> list[int] | None:
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
            if self.allocator.num_free < n:
                return None
        return self.allocator.allocate(n)

    def _reserve(self, req: Request, n: int) -> bool:
        """Make sure `req` has blocks for its next `n` tokens."""
        need = math.ceil((req.num_computed + n) / self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self._allocate(need)
        if blocks is None:
            return False
        req.block_table += blocks
        return True

    def _release(self, req: Request) -> None:
        """Give back the request's blocks, lock and slot; forget in-flight samples."""
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
            req.cache_handle = None
        self.allocator.decref(req.block_table)
        req.block_table = []
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
        g = req.group
        if g is not None and req is g.parent:
            self._free_slots += g.reserved_slots
            g.reserved_slots = []
        req.num_computed = req.num_kv_done = req.num_table_sent = 0
        req.num_inflight_samples = 0
        req.awaiting_host_result = False

    def _preempt(self, req: Request) -> None:
        """Free the request's KV and put it at the head of the waiting queue (it will be
        recomputed, reusing whatever the prefix cache still holds). A group member takes its
        whole group: the children leave (holding nothing), the parent is requeued and forks
        them again once it recomputed the shared prefix."""
        g = req.group
        if g is not None:
            for child in g.children:
                if child.status is Status.RUNNING:
                    self._unrun(child)
                    child.beam_top_logprobs = None
            g.ready = False
            req = g.parent
        self._unrun(req)
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _unrun(self, seq: Request) -> None:
        """Preemption of one sequence: out of `running`, its KV freed, a new epoch (results of
        steps in flight for it are ignored), waiting again."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.epoch += 1
        seq.status = Status.WAITING
        seq.num_preemptions += 1

    def _plan_row(self, req: Request, n: int, drafts: Sequence[int] = ()) -> PlanRow:
        """The row of `req` feeding its next `n` tokens (the last len(drafts) of them
        drafts); marks them computed and the sample in flight."""
        start, seq = req.num_computed, req.seq_token_ids
        p = req.params
        reads_last = req.num_inflight_samples > 0
        assert not reads_last or (n == 1 and start == len(seq)), "one in-flight sample at most"
        k = len(drafts)
        samples = start + n - k == req.seq_len and req.max_tokens > 0
        row = PlanRow(
            rid=req.rid,
            slot=req.slot,
            start=start,
            num_tokens=n,
            input_ids=[] if reads_last else seq[start : start + n - k] + list(drafts),
            reads_last_sample=reads_last,
            table_start=req.num_table_sent,
            new_blocks=req.block_table[req.num_table_sent :],
            sample_offsets=list(range(n - 1 - k, n)) if samples else [],
            num_draft_tokens=k,
            drafts_on_device=k > 0 and getattr(self.proposer, "drafts_on_device", False),
            params=p,
            num_output_before=req.num_output + req.num_inflight_samples,
        )
        req.num_table_sent = len(req.block_table)
        if p.has_penalties:
            row.history, row.prompt_len = list(seq), req.prompt_len
        # Penalties need the whole output on the host; so does the proposer, to draft, and
        # beam search, to pick the next beams.
        is_beam = req.group is not None and req.group.beam is not None and req.reports is False
        row.needs_host_result = p.has_penalties or self.proposer is not None or is_beam
        if req.grammar is not None and samples:  # the next mask needs this step's token
            row.token_bitmask = self._grammar_masks(req, drafts)
            row.needs_host_result = True
        self.stats.num_prompt_tokens_computed += max(0, min(start + n, req.prompt_len) - start)
        if p.prompt_logprobs:
            lo = max(start, p.logprob_start_len - 1)
            hi = min(start + n, req.prompt_len - 1)
            if hi > lo:
                row.prompt_logprobs = PromptLogprobs(lo - start, seq[lo + 1 : hi + 1])
        req.num_computed += n
        if samples:
            req.num_inflight_samples += 1
        req.awaiting_host_result = row.needs_host_result
        return row


def _is_swap(op: object) -> bool:
    return isinstance(op, SwapIn | SwapOut)


def _queued(req: Request) -> bool:
    """Whether a WAITING request sits in the waiting queue (a group's children wait inside
    their group instead)."""
    return req.group is None or req is req.group.parent
