"""A request's state inside the scheduler (plain Python; the runner never sees it)."""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from radixrt.cache.namespace import CacheNamespace
from radixrt.deltas import FinishReason
from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams
from radixrt.tenant import Tenant

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORKED = "forked"  # a fork parent whose children run (it holds nothing)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """What the scheduler's core needs of a request. Features keep their own per-request
    state (grammar matchers, verify counts, beams' top log-probs) in tables keyed by the
    request (it hashes by identity); see `radixrt.scheduler.features`."""

    rid: str
    prompt_len: int
    seq_token_ids: list[int]  # the sequence: prompt, then the output tokens on the host
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context (see limits.py)
    status: RequestStatus = RequestStatus.WAITING
    arrival: int = field(default_factory=lambda: next(_arrival_counter))  # FCFS order
    block_table: list[int] = field(default_factory=list)  # KV blocks, position p -> [p // B]
    slot: int | None = None  # runner-side row state while the request holds blocks
    slot_incarnation: int = 0  # of the SlotEntry that set that state (radixrt.plan)
    num_output_counted: int = 0  # output tokens the slot's penalty counts hold (on the host
    # or in flight: the runner counts its own samples)
    num_table_sent: int = 0  # block-table entries the runner's slot already has
    # KV positions written by executed steps or by steps in flight (planned and launched)
    num_computed: int = 0
    num_kv_done: int = 0  # of those, written by steps whose result was applied
    # tokens sampled by a step in flight whose value is not on the host yet (0 or 1); the
    # next decode step reads it on the device
    num_inflight_samples: int = 0
    # features whose row of this request is in flight and needed on the host: not schedulable
    awaiting_result_for: tuple[str, ...] = ()
    epoch: int = 0  # bumped by preemption: results of older steps are dropped
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_host_cached_tokens: int = 0  # of those (at the latest admission), from the host tier
    cache_handle: Any = None  # locked prefix-cache node, None when nothing is locked
    waited_steps: int = 0  # scheduler steps spent waiting (aging)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR: what went wrong
    invalid_request: bool = False  # with ERROR: the request's own fault (a bad grammar: 400)
    unavailable: bool = False  # with ERROR: a part it needs is down (the grammar compiler: 503)
    output_logprobs: list[float] = field(default_factory=list)  # when params.logprobs
    # when params.top_logprobs: per output token, the most likely (token, log-prob) pairs
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # when params.prompt_logprobs: log-probs of prompt tokens [logprob_start_len, prompt_len)
    prompt_logprobs: list[float] = field(default_factory=list)
    admission_seq: int = 0  # order of the latest admission (preemption picks the newest)
    group: RequestGroup | None = None  # n > 1 or beam search: parent, children / beams
    index: int = 0  # a fork child's index (choice) in its group
    reports: bool = True  # gets RequestDeltas (False: an n > 1 parent, a beam)
    tenant: Tenant | None = None  # None: the server has no tenants (one tenant)
    options: RequestOptions = DEFAULT_OPTIONS  # cache salt, priority, retention, LoRA adapter
    queued_at: float = 0.0  # the scheduler's clock when it was queued (the wait bound)

    @property
    def cache_salt(self) -> str | None:
        """The request's tenant cache salt (None: unsalted); see RequestOptions."""
        return self.options.cache_salt

    @functools.cached_property
    def cache_namespace(self) -> CacheNamespace:
        """The prefix-cache namespace of the request: it shares cached KV only within it
        (made once: drafts ask for it every decode step)."""
        lora = self.options.lora
        return CacheNamespace(self.options.cache_salt, None if lora is None else lora.key)

    @property
    def priority(self) -> int:
        """Lower runs first (RequestOptions.priority)."""
        return self.options.priority

    @property
    def num_output(self) -> int:
        """Output tokens on the host."""
        return len(self.seq_token_ids) - self.prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq_token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq_token_ids[self.prompt_len :]

    @property
    def seq_len(self) -> int:
        """Sequence length counting samples still in flight."""
        return len(self.seq_token_ids) + self.num_inflight_samples

    @property
    def num_pending(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return self.seq_len - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def fork_rid(rid: str, index: int) -> str:
    """Request id of child `index` of an n > 1 request `rid`."""
    return f"{rid}#{index}"


@dataclass(eq=False)
class RequestGroup:
    """Requests that share a prompt's KV by block references.

    The parent prefills the prompt but its last token once (it samples nothing), then forks:
    each child takes references to the parent's full blocks and its own copy of the partial
    last block (child 0 takes over the parent's blocks and slot) and feeds the prompt's last
    token itself. The group is scheduled, preempted (all of it: the parent requeued, the
    shared prefix recomputed once, then each child recomputes its own suffix) and aborted as
    one. `beam` is the host-side beam-search state (beams are the children then)."""

    parent: Request
    children: list[Request]  # unfinished children (n > 1) / live beams, in index order
    reserved_slots: list[int] = field(default_factory=list)  # held for children to come
    ready: bool = False  # the parent's prefill is done: fork at the next schedule()
    beam: Any = None  # radixrt.scheduler.beam.BeamState for beam search

    @property
    def num_slots(self) -> int:
        """Slots the group needs while it runs."""
        return len(self.children) if self.beam is None else self.beam.width
