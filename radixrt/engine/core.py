"""EngineCore: scheduler + prefix cache + KV pool + model runner, tokens only.

The in-process `Engine` wraps it with a tokenizer and detokenizers; the server's
scheduler process drives it directly and ships token ids to the front process."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence

from radixrt.cache import create_prefix_cache
from radixrt.config import EngineConfig, ModelConfig
from radixrt.engine.runner import ModelRunner
from radixrt.kv.allocator import BlockAllocator
from radixrt.sampling import SamplingParams
from radixrt.scheduler.request import Request
from radixrt.scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(
        self, cfg: EngineConfig, model_config: ModelConfig, eos_token_ids: Sequence[int]
    ) -> None:
        self.config = cfg
        self.model_config = model_config
        self.max_model_len = cfg.max_model_len or model_config.max_position_embeddings
        self.runner = ModelRunner(cfg, model_config, self.max_model_len)
        self.allocator = BlockAllocator(self.runner.num_usable_blocks)
        self.cache = create_prefix_cache(
            cfg.cache.prefix_cache, self.allocator, cfg.cache.block_size
        )
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.allocator,
            self.cache,
            self.runner.pool,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
        )
        self._ids = itertools.count()

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None
    ) -> Request:
        """Queue one request. Raises ValueError on bad input (nothing is queued then)."""
        ids = [int(t) for t in prompt_ids]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Request(rid=rid, prompt_len=len(ids), token_ids=ids, params=params)
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[Request]:
        """One scheduler step; returns the requests that got a token or finished."""
        sched = self.scheduler
        batch = sched.schedule()
        if batch is None:
            return []
        return sched.update(batch, self.runner.forward(batch, sched.tables))

    def abort(self, rid: str, reason: str = "abort") -> Request | None:
        return self.scheduler.abort(rid, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, float]:
        s, c = self.scheduler.stats, self.cache.stats
        return {
            "num_requests": s.num_requests,
            "prompt_tokens": s.num_prompt_tokens,
            "cached_tokens": s.num_cached_tokens,
            "cache_hit_rate": s.cache_hit_rate,
            "generated_tokens": s.num_generated_tokens,
            "preemptions": s.num_preemptions,
            "cow_copies": s.num_cow_copies,
            "inplace_appends": s.num_inplace_appends,
            "evicted_blocks": c.num_evicted_blocks,
            "steps": s.num_steps,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached": self.cache.cached_blocks,
        }
