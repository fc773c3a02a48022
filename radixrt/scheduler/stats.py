"""The scheduler's live counters (`EngineCore.stats_struct()` reads them into `EngineStats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from radixrt.speculative.base import SpecStats


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
    num_retention_holds: int = 0  # finished prompts held cached (SamplingParams.cache_ttl_s)
    num_retention_expired: int = 0  # of those, ended by their time to live
    num_retention_released: int = 0  # of those, given up for room (share bound, short pool)
    num_retention_refused: int = 0  # holds not taken: older lineages fill the share bound
    finish_reasons: Counter = field(default_factory=Counter)
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
