"""EngineCore: scheduler + prefix cache + model runner, tokens only; THE driver loop.

The in-process `Engine`, the server's scheduler process, the frontend DSL (through `Engine`) and
the benchmark driver all call `step()`, which returns one `RequestDelta` per request that
got tokens or finished; progress per request is tracked here and nowhere else.

One step (`overlap_schedule=False`): plan, execute, apply the result. With overlap the step
plans and launches step N+1 first and then applies step N's result, so the host's planning
and bookkeeping run while the device computes (decode rows of N+1 read N's samples on the
device). Outputs are the same either way.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict

import msgspec

from radixrt.cache import create_prefix_cache
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage import PageKeyer, StorageTier
from radixrt.cache.storage_backends import storage_medium
from radixrt.cache.storage_cost import StorageCostModel
from radixrt.config import EngineConfig, ModelConfig
from radixrt.deltas import BeamOut, FinishReason, RequestDelta
from radixrt.engine.tier_stats import host_tier_stats, storage_tier_stats
from radixrt.errors import RequestValueError
from radixrt.grammar.base import GrammarBackend, GrammarStats
from radixrt.grammar.spec import grammar_spec
from radixrt.kv.allocator import BlockAllocator
from radixrt.limits import resolve_max_model_len, resolve_max_tokens
from radixrt.plan import Runner, StepHandle, StepPlan
from radixrt.sampling import (
    DEFAULT_OPTIONS,
    BeamSearchParams,
    LoraRef,
    RequestOptions,
    SamplingParams,
)
from radixrt.scheduler.beam import BeamHypothesis
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.scheduler.scheduler import Scheduler
from radixrt.speculative import create_proposer
from radixrt.stats import CachePressure, EngineStats
from radixrt.tenant import Tenant

logger = logging.getLogger(__name__)
# A step that planned nothing while grammars compile waits this long (or until one is done)
# for them instead of spinning (a spinning loop also starves the compile threads of the GIL)
GRAMMAR_IDLE_WAIT_S = 0.01


class EngineCore:
    def __init__(
        self,
        cfg: EngineConfig,
        model_config: ModelConfig,
        eos_token_ids: Sequence[int],
        runner: Runner | None = None,
        num_kv_blocks: int | None = None,
        grammar_backend: GrammarBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`runner` replaces the ModelRunner (scripted runners in tests and simulations,
        which then give `num_kv_blocks`). `grammar_backend` serves structured output
        (radixrt.grammar.base.GrammarBackend); None: xgrammar's, made lazily for the model's
        tokenizer when the ModelRunner is used and xgrammar is installed. `clock`: the
        scheduler's seconds (how long requests wait, retention holds' times)."""
        self.config = cfg
        self.model_config = model_config
        self.max_model_len = resolve_max_model_len(
            cfg.max_model_len, model_config.max_position_embeddings, model_config.sliding_window
        )
        num_slots = cfg.scheduler.max_running_requests
        own_runner = runner is None
        if runner is None and cfg.tensor_parallel_size > 1:
            from radixrt.executor.tp.runner import TensorParallelRunner

            runner = TensorParallelRunner(cfg, model_config, self.max_model_len, num_slots)
            num_kv_blocks = runner.num_usable_blocks
        elif runner is None:
            from radixrt.executor.runner import ModelRunner

            runner = ModelRunner(cfg, model_config, self.max_model_len, num_slots)
            num_kv_blocks = runner.num_usable_blocks
        if grammar_backend is None and own_runner:
            grammar_backend = _xgrammar_backend(cfg, model_config, eos_token_ids)
        self.grammar_backend: GrammarBackend | None = grammar_backend
        assert num_kv_blocks is not None, "a custom runner needs num_kv_blocks"
        self.runner = runner
        self.allocator = BlockAllocator(num_kv_blocks)
        # Host KV tier: our runner sized its host pool; a custom runner takes the config's.
        num_host_blocks = (
            runner.num_host_blocks if own_runner else cfg.cache.num_host_kv_blocks or 0
        )
        self.kv_events = _kv_event_recorder(cfg)  # None: KV events off
        self.cache = create_prefix_cache(
            cfg.cache.prefix_cache,
            self.allocator,
            cfg.cache.block_size,
            num_host_blocks,
            self.kv_events,
            _storage_tier(cfg, runner) if own_runner else None,
        )
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.allocator,
            self.cache,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            proposer=create_proposer(cfg.speculative, self.cache),
            grammar_backend=grammar_backend,
            jump_forward=cfg.grammar.jump_forward,
            jump_forward_retokenize=cfg.grammar.jump_forward_retokenize,
            max_graph_tokens=runner.max_graph_tokens if own_runner else 0,
            overlap=cfg.overlap_schedule,
            max_loras=cfg.lora.max_loras,
            clock=clock,
        )
        self._ids = itertools.count()
        self._inflight: tuple[StepPlan, StepHandle] | None = None
        self._sent: dict[str, int] = {}  # rid -> output tokens already in deltas
        self._aborted: list[Request] = []  # children of an aborted n > 1 request: next step
        self._froze_gc = False
        if cfg.freeze_gc:
            # What exists now (weights, graphs, modules) lives as long as the engine: keep
            # full collections from rescanning it; `shutdown` unfreezes.
            gc.collect()
            gc.freeze()
            self._froze_gc = True

    @property
    def overlap(self) -> bool:
        """Whether a step plans and launches the next before applying its result (the
        config's `overlap_schedule`; settable between steps)."""
        return self.scheduler.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.scheduler.overlap = on

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        rid: str | None = None,
        tenant: Tenant | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> str:
        """Queue one request of `tenant` (None: no tenants) with `options` (cache salt,
        priority, retention, LoRA adapter); returns its id (generated when `rid` is None).
        Raises ValueError on bad input (nothing is queued then): a RequestValueError naming
        the field at fault where one is."""
        ids = self._check_ids(prompt_ids)
        self._check_lora(options.lora)
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise RequestValueError(
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                "logit_bias",
            )
        max_tokens = resolve_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        if rid is None:
            rid = self._new_rid()
        req = Request(
            rid=rid,
            prompt_len=len(ids),
            seq_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            tenant=tenant,
            options=options,
        )
        if params.n > 1:
            # deltas come per child: rid fork_rid(rid, i), parent_rid rid, index i
            for child in self.scheduler.add_fork(req):
                self._sent[child.rid] = 0
            return rid
        self.scheduler.add_request(req)
        self._sent[rid] = 0
        return rid

    def add_beam_search(
        self,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        rid: str | None = None,
        tenant: Tenant | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> str:
        """Queue a beam search of `tenant` with `options`; its one delta (when it ends)
        carries `beams`, best first. Raises ValueError on bad input (nothing is queued then)."""
        ids = self._check_ids(prompt_ids)
        self._check_lora(options.lora)
        max_tokens = resolve_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        if max_tokens < 1:
            raise RequestValueError("beam search needs room for at least one token in the context")
        rid = rid if rid is not None else self._new_rid()
        self.scheduler.add_beam_search(rid, ids, params, max_tokens, tenant, options)
        self._sent[rid] = 0
        return rid

    def _check_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt_ids]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestValueError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
            )
        if not ids:
            raise RequestValueError("the prompt is empty: give at least one token", "prompt")
        return ids

    def _check_lora(self, lora: LoraRef | None) -> None:
        if lora is not None and not self.config.lora.enabled:
            raise RequestValueError(
                f"the request asks for LoRA adapter {lora.name!r}, but LoRA is off (max_loras=0)",
                "lora",
            )

    def requests_using_lora(self, key: str) -> list[str]:
        """Ids of the live requests that run under the adapter of key `key`."""
        return [
            rid
            for rid, r in self.scheduler.queues.requests.items()
            if r.options.lora is not None and r.options.lora.key == key
        ]

    def _new_rid(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def step(self) -> list[RequestDelta]:
        """One loop iteration; returns the deltas of the requests that changed.

        A step whose execution raises fails its requests (FinishReason.ERROR) and the loop
        goes on; an error that leaves the device unusable (a CUDA error) raises
        FatalEngineError."""
        sched = self.scheduler
        changed: list[Request] = self._aborted
        self._aborted = []
        if self._inflight is not None and sched.wants_result_first():
            # verify rows in flight: take their result first rather than leave them out
            prev_plan, prev_handle = self._inflight
            self._inflight = None
            changed += self._finish_step(prev_plan, prev_handle)
        plan = sched.schedule()
        changed += sched.drain_finished()
        handle = None
        if plan is not None:
            try:
                handle = self._execute(plan)
            except Exception as e:
                changed += self._step_failed(plan, e)
        if self._inflight is not None:
            prev_plan, prev_handle = self._inflight
            self._inflight = None
            changed += self._finish_step(prev_plan, prev_handle)
            if handle is None and self.overlap:
                # Nothing could be planned while every row waited for that result on the
                # host (grammar masks, beams): plan again now that it is there.
                plan = sched.schedule()
                changed += sched.drain_finished()
                if plan is not None:
                    try:
                        handle = self._execute(plan)
                    except Exception as e:
                        changed += self._step_failed(plan, e)
        if handle is not None:
            if self.overlap:
                self._inflight = (plan, handle)
            else:
                changed += self._finish_step(plan, handle)
        elif not changed and self._inflight is None:
            if isinstance(self.cache, StorageRadixCache) and self.cache.num_fetches:
                self.runner.storage_wait(GRAMMAR_IDLE_WAIT_S)  # don't spin on storage reads
            sched.wait_for_grammars(GRAMMAR_IDLE_WAIT_S)  # nothing ran: don't spin on compiles
        if self._inflight is None:
            # nothing runs: the step's new cache entries go to storage now (the loop may idle),
            # and fetches a waiting request needs come back
            self._exchange_storage()
        return self._deltas(changed)

    def _execute(self, plan: StepPlan) -> StepHandle:
        """Run `plan`; the storage tier's queued ops go first (a write-through page is copied
        off the device before this plan's ops and forward can rewrite its block)."""
        self._exchange_storage()
        return self.runner.execute(plan)

    def _exchange_storage(self) -> None:
        """Hand the storage tier's queued ops to the runner; what finished comes back to the
        cache (fetches enter the tree; stored and removed pages become KV events)."""
        if isinstance(self.cache, StorageRadixCache):
            self.cache.finish_storage_io(self.runner.storage_io(self.cache.storage.take_ops()))

    def _finish_step(self, plan: StepPlan, handle: StepHandle) -> list[Request]:
        try:
            result = handle.result()
        except Exception as e:
            return self._step_failed(plan, e)
        return self.scheduler.update(plan, result)

    def _step_failed(self, plan: StepPlan, error: Exception) -> list[Request]:
        self.check_health()  # a runner that cannot go on (a dead tensor-parallel rank) raises
        if _is_fatal(error):
            raise FatalEngineError(f"the device failed: {error}") from error
        logger.error("step %d failed (%d rows)", plan.step_id, len(plan.rows), exc_info=error)
        return self.scheduler.fail_step(plan, f"the engine step failed: {type(error).__name__}")

    def release_cache_hold(self, rid: str) -> bool:
        """End the retention hold of finished request `rid` early (its `cache_ttl_s`); False
        when it holds nothing (never had a hint, expired, or released for room)."""
        return self.scheduler.retention.release(rid)

    def cache_pressure(
        self, salts: Callable[[str | None], bool] | None = None, tenant: Tenant | None = None
    ) -> CachePressure:
        """The pool's fill with retention holds now (between steps): plain data for clients
        that decide how many held contexts to run at once (`CachePressure`). `salts`: the
        figures of the holds under the cache salts it accepts only (one tenant's, `tenant`):
        its held blocks and holds against the tenant's bound; figures that show others' use
        are None."""
        retention = self.scheduler.retention
        if salts is not None:
            mine = {r: h for r, h in retention.holds.items() if salts(h.salt)}
            return CachePressure(
                num_blocks=self.allocator.num_blocks,
                block_size=self.config.cache.block_size,
                free_blocks=None,
                evictable_blocks=None,
                held_blocks=len({b for h in mine.values() for b in h.blocks}),
                max_held_blocks=retention.max_tenant_blocks(tenant),
                holds_refused=None,
                held=frozenset(mine),
            )
        return CachePressure(
            num_blocks=self.allocator.num_blocks,
            block_size=self.config.cache.block_size,
            free_blocks=self.allocator.num_free,
            evictable_blocks=self.cache.evictable_blocks,
            held_blocks=retention.num_held_blocks,
            max_held_blocks=retention.max_blocks,
            holds_refused=self.scheduler.stats.retention_refused,
            held=frozenset(retention.holds),
        )

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> RequestDelta | None:
        """Finish a request now; returns its last delta, or None if it is unknown. The id an
        n > 1 request was added with aborts every child: their last deltas come with the next
        `step()` (and this returns None)."""
        req = self.scheduler.requests.get(rid)
        if req is not None and not req.reports:  # an n > 1 parent
            children = list(req.group.children)
            self.scheduler.abort(rid, reason)
            self._aborted += children
            return None
        req = self.scheduler.abort(rid, reason)
        return None if req is None else self._delta(req)

    def take_kv_events(self) -> list:
        """The KV cache events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
        radixrt.cache.kv_events) of the steps since the last call, in order; [] when
        `kv_events` is off. The server publishes them once per step."""
        return self.kv_events.take() if self.kv_events is not None else []

    def check_health(self) -> None:
        """Raise (TensorParallelError) if the runner can no longer run steps: a
        tensor-parallel rank died or failed. Cheap (no collective); the server calls it
        while idle so that it can answer 503 before the next request."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Release the runner: stops tensor-parallel worker processes (idempotent); the
        storage tier's queued writes go first."""
        self._exchange_storage()
        self.runner.close()
        if self.grammar_backend is not None:
            self.grammar_backend.close()
        if self._froze_gc:
            gc.unfreeze()  # the engine's objects can be collected again
            self._froze_gc = False

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None or bool(self._aborted)

    def request(self, rid: str) -> Request | None:
        """The live request (read-only use: tests, introspection)."""
        return self.scheduler.requests.get(rid)

    def _deltas(self, changed: list[Request]) -> list[RequestDelta]:
        """The deltas of the requests that changed, one each. A request whose delta cannot be
        made (a bug) fails alone, with its group: an ERROR delta for it and for each member
        that reports (replacing a delta such a member already got this step)."""
        todo = _unique(changed)
        out: dict[int, RequestDelta] = {}  # id(request) -> its delta, in order
        for req in todo:  # grows while iterating: members of a group that failed here
            try:
                out[id(req)] = self._delta(req)
            except Exception as e:  # reporting one request failed: that request fails
                logger.error("reporting request %s failed", req.rid, exc_info=e)
                message = f"internal error: {type(e).__name__}: {e}"
                for member in self._fail_for_report(req, message):
                    if out.pop(id(member), None) is not None or all(r is not member for r in todo):
                        todo.append(member)  # (again) for its last delta
                out[id(req)] = self._error_delta(req, message)
        return list(out.values())

    def _fail_for_report(self, req: Request, message: str) -> list[Request]:
        """Fail `req` (live: with its group; finished: only counted). Returns the other
        members of its group that failed with it and report."""
        if req.status is RequestStatus.FINISHED:
            self.scheduler.stats.failed_requests += int(req.reports)
            return []
        return [r for r in self.scheduler.fail_request(req, message) if r is not req]

    def _error_delta(self, req: Request, message: str) -> RequestDelta:
        """The last delta of a request that failed while its delta was made (built from
        nothing that could have failed)."""
        self._sent.pop(req.rid, None)
        g = req.group
        child = g is not None and req is not g.parent
        return RequestDelta(
            rid=req.rid,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            prompt_tokens=req.prompt_len,
            num_output_tokens=0,
            num_cached_tokens=0,
            error=message,
            parent_rid=g.parent.rid if child else None,
            index=req.index,
        )

    def _delta(self, req: Request) -> RequestDelta:
        sent = self._sent[req.rid]
        p = req.params
        finished = req.finish_reason is not None
        g = req.group
        if g is not None and req is g.parent:  # beam search: one delta at the end
            assert finished and g.beam is not None
            del self._sent[req.rid]
            return RequestDelta(
                rid=req.rid,
                new_token_ids=[],
                finish_reason=req.finish_reason,
                prompt_tokens=req.prompt_len + 1,
                num_output_tokens=0,
                num_cached_tokens=req.num_cached_tokens,
                beams=[_beam_out(h) for h in g.beam.finished]
                if req.finish_reason in _BEAMS_DONE
                else [],
                error=req.error,
            )
        delta = RequestDelta(
            rid=req.rid,
            new_token_ids=req.seq_token_ids[req.prompt_len + sent :],
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            num_output_tokens=req.num_output,
            num_cached_tokens=g.parent.num_cached_tokens
            if g is not None
            else req.num_cached_tokens,
            error=req.error,
            invalid_request=req.invalid_request,
            unavailable=req.unavailable,
            error_param=_constraint_field(req) if req.invalid_request else None,
            new_logprobs=req.output_logprobs[sent:] if p.logprobs else [],
            new_top_logprobs=req.output_top_logprobs[sent:] if p.top_logprobs else [],
            prompt_logprobs=list(req.prompt_logprobs) if finished else [],
            parent_rid=g.parent.rid if g is not None else None,
            index=req.index,
        )
        spec = self.scheduler.speculation
        if spec is not None:
            delta.num_draft_tokens, delta.num_accepted_tokens = spec.verified(req)
        if finished:
            del self._sent[req.rid]
        else:
            self._sent[req.rid] = req.num_output
        return delta

    def flush_cache(self, salts: Callable[[str | None], bool] | None = None) -> int:
        """Drop every unlocked prefix-cache entry on every tier, between steps, retention
        holds ended first; running requests keep their locked paths, waiting ones match again
        (the cache's version changes). `salts`: only entries (and holds) under the cache salts
        it accepts (`PrefixCache.flush_salts`). Checks integrity after (AssertionError).
        Returns the blocks freed."""
        free = self.allocator.num_free
        retention = self.scheduler.retention
        for rid in [r for r, h in retention.holds.items() if salts is None or salts(h.salt)]:
            retention.release(rid)
        if salts is None:
            self.cache.reset()
        else:
            self.cache.flush_salts(salts)
        self.check_integrity()
        return self.allocator.num_free - free

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.grammar_backend is not None:
            self.grammar_backend.check_integrity()
        reporting = {rid for rid, r in self.scheduler.requests.items() if r.reports}
        pending = {r.rid for r in self._aborted}
        assert set(self._sent) - pending == reporting, "delta bookkeeping leaked"
        inflight = 0 if self._inflight is None else 1
        assert self.scheduler.num_inflight_steps == inflight, "a launched plan was lost"

    def stats(self) -> dict[str, float]:
        """`stats_struct()` as a flat dict (`EngineStats.as_dict`)."""
        return self.stats_struct().as_dict()

    def stats_struct(self) -> EngineStats:
        """Counters since start and the state after the latest step (a new struct): the
        scheduler's counters as they are, then the gauges and the other components' stats."""
        sched = self.scheduler
        total, free = self.allocator.num_blocks, self.allocator.num_free
        counters = sched.stats
        return EngineStats(
            **msgspec.structs.asdict(counters),
            running=len(sched.running),
            waiting=len(sched.waiting),
            cache_hit_rate=counters.cached_tokens / counters.prompt_tokens
            if counters.prompt_tokens
            else 0.0,
            kv_blocks_total=total,
            kv_tokens_total=total * self.config.cache.block_size,
            kv_fp8=float(self.config.cache.kv_fp8),
            kv_blocks_free=free,
            kv_blocks_cached=self.cache.cached_blocks,
            kv_blocks_in_use=total - free - self.cache.evictable_blocks,
            evicted_blocks=self.cache.stats.num_evicted_blocks,
            **self._grammar_stats(),
            retention_held_blocks=sched.retention.num_held_blocks,
            **sched.spec_stats.as_engine_stats(),
            **host_tier_stats(self.cache, self.runner),
            **storage_tier_stats(self.cache, self.runner),
        )

    def _grammar_stats(self) -> dict[str, int]:
        """GrammarStats fields (zero without a backend)."""
        backend = self.grammar_backend
        return asdict(backend.stats() if backend is not None else GrammarStats())


_BEAMS_DONE = (FinishReason.STOP, FinishReason.LENGTH)  # a beam search that has results


def _beam_out(h: BeamHypothesis) -> BeamOut:
    reason = FinishReason.STOP if h.stopped else FinishReason.LENGTH
    return BeamOut(h.output_token_ids, h.cumulative_logprob, h.score, reason)


class FatalEngineError(RuntimeError):
    """The engine cannot go on (the device failed); the process should exit."""


def _kv_event_recorder(cfg: EngineConfig):
    if not cfg.cache.kv_events:
        return None
    from radixrt.cache.kv_events import BlockHasher
    from radixrt.cache.radix_events import RadixEventRecorder

    return RadixEventRecorder(BlockHasher(cfg.cache.block_size, cfg.cache.kv_events_hash_seed))


def _is_fatal(error: Exception) -> bool:
    """CUDA errors leave the context unusable; anything else fails one step."""
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


def _xgrammar_backend(
    cfg: EngineConfig, model_config: ModelConfig, eos_token_ids: Sequence[int]
) -> GrammarBackend | None:
    """xgrammar's GrammarBackend over the checkpoint's tokenizer, or None (with a log line)
    when xgrammar is not installed: constrained requests are then refused."""
    try:
        from radixrt.grammar.xgrammar_backend import XGrammarBackend
    except ImportError as e:
        logger.info("structured output off: %s", e)
        return None
    g = cfg.grammar
    return XGrammarBackend(
        cfg.model_path,
        model_config.vocab_size,
        eos_token_ids,
        compile_timeout_s=g.grammar_compile_timeout_s,
        num_workers=g.grammar_compile_workers,
        mask_threads=g.grammar_mask_threads,
        cache_bytes=g.grammar_cache_bytes,
    )


def _constraint_field(req: Request) -> str:
    """The SamplingParams field of the request's constraint (a request fails as invalid only
    for its grammar)."""
    spec = grammar_spec(req.params)
    assert spec is not None, f"{req.rid} failed as invalid without a constraint"
    return spec.field


def _unique(reqs: list[Request]) -> list[Request]:
    seen: set[int] = set()
    out = []
    for r in reqs:
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
    return out


def _storage_tier(cfg: EngineConfig, runner: Runner) -> StorageTier | None:
    """The storage tier's scheduler side, keyed by what the runner's pool holds."""
    identity = runner.storage_identity if cfg.cache.kv_storage is not None else None
    if identity is None:
        return None
    keyer = PageKeyer(identity, cfg.cache.block_size)
    cost = StorageCostModel(cfg.cache.kv_storage_load_policy)
    medium = storage_medium(cfg.cache.kv_storage)
    return StorageTier(keyer, cfg.cache.kv_storage_prefetch_timeout_s, cost, medium)
