"""Typed messages between the front process and the scheduler process (msgpack via msgspec).

front -> scheduler (`ToScheduler`): `TokenizedRequest` (n > 1: one message, the scheduler
forks the children), `BeamSearchRequest`, `AbortRequest`, `FlushCache`, `ReleaseCacheHolds`,
`ReadCachePressure`, `Shutdown`.
scheduler -> front (`FromScheduler`): `Ready` once after the model loads, then one
`TokenBatchOut` per loop iteration that did something (a step, or handled messages), which
carries the engine's `RequestDelta`s as they are (`radixrt.deltas`), and `SchedulerFailed` if
the loop dies of an exception, `CacheFlushed` per `FlushCache`, `CacheHoldsReleased` per
`ReleaseCacheHolds`, `CachePressureRead` per `ReadCachePressure`.
"""

from __future__ import annotations

import msgspec

from radixrt.deltas import RequestDelta
from radixrt.sampling import DEFAULT_OPTIONS, BeamSearchParams, RequestOptions, SamplingParams
from radixrt.stats import CachePressure, EngineStats
from radixrt.tenant import Tenant


# ---- front -> scheduler ----
class TokenizedRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: Tenant | None = None  # who sent it, from its API key (None: no tenants)
    options: RequestOptions = DEFAULT_OPTIONS  # cache salt, priority, retention, adapter


class BeamSearchRequest(msgspec.Struct, tag=True, frozen=True):
    """A beam search (EngineCore.add_beam_search): one RequestDelta when it ends, with `beams`."""

    rid: str
    prompt_ids: list[int]
    params: BeamSearchParams
    tenant: Tenant | None = None  # as TokenizedRequest's
    options: RequestOptions = DEFAULT_OPTIONS  # as TokenizedRequest's


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    """End request `rid` (an n > 1 request: every child), or with `index` only child
    `index` of the n > 1 request `rid` (its stop string was seen; the others go on)."""

    rid: str
    reason: str = "abort"  # "abort" (client gone, /abort) | "stop" (front saw a stop string)
    index: int | None = None


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


class SaltScope(msgspec.Struct, frozen=True):
    """The cache salts of one tenant: those that start with `prefix`, and the unsalted
    namespace too when `unsalted` (the shared tenant's)."""

    prefix: str
    unsalted: bool = False

    def covers(self, salt: str | None) -> bool:
        return self.unsalted if salt is None else salt.startswith(self.prefix)


class FlushCache(msgspec.Struct, tag=True, frozen=True):
    """Drop every unlocked prefix-cache entry (running requests keep their paths), or only
    those under the salts of `scope`; the scheduler answers with `CacheFlushed` carrying the
    same `flush_id`."""

    flush_id: int
    scope: SaltScope | None = None  # None: every salt


class ReleaseCacheHolds(msgspec.Struct, tag=True, frozen=True):
    """End the retention holds of the finished scheduler requests `rids` early
    (`EngineCore.release_cache_hold`); the scheduler answers with `CacheHoldsReleased`
    carrying the same `call_id`."""

    call_id: int
    rids: list[str]


class ReadCachePressure(msgspec.Struct, tag=True, frozen=True):
    """Read the engine's `CachePressure` (its held figures of the salts of `scope` only,
    against the bound of `tenant`'s holds); the scheduler answers with `CachePressureRead`
    carrying the same `call_id`."""

    call_id: int
    scope: SaltScope | None = None  # None: every salt
    tenant: Tenant | None = None  # with `scope`: the caller's tenant


ToScheduler = (
    TokenizedRequest
    | BeamSearchRequest
    | AbortRequest
    | Shutdown
    | FlushCache
    | ReleaseCacheHolds
    | ReadCachePressure
)


# ---- scheduler -> front ----
class Ready(msgspec.Struct, tag=True, frozen=True):
    pid: int  # the scheduler process
    max_model_len: int  # prompt + output tokens of one request at most
    vocab_size: int
    kv_blocks_total: int
    block_size: int
    max_running_requests: int = 256  # sequences that run at once (n, beam_width at most)
    num_eos_ids: int = 1  # the EOS ids beam search ranks candidates for
    policy: str = "fcfs"  # the waiting-queue policy (SchedulerConfig.policy, resolved)
    prefix_cache: str = "radix"  # radix | blockhash | none (CacheConfig.prefix_cache)


class RequestError(msgspec.Struct, frozen=True):
    """A request the scheduler refused (EngineCore.add_request raised ValueError: 400) or
    failed on its side (an exception while planning, stopping or running it: 500)."""

    rid: str
    message: str
    status: int = 400  # the HTTP status the client gets: 400 its input, 500 a server fault
    parent_rid: str | None = None  # a child of an n > 1 request: the rid it was sent with
    index: int = 0  # that child's choice index
    param: str | None = None  # 400: the request field at fault, when known
    grammar: bool = False  # 400: the structured output did not compile


class SchedulerSnapshot(msgspec.Struct, frozen=True):
    """Engine state after the step: `EngineCore.stats_struct()` as it is."""

    stats: EngineStats
    integrity_error: str | None = None  # debug mode: check_integrity() failure when idle


class TokenBatchOut(msgspec.Struct, tag=True, frozen=True):
    outputs: list[RequestDelta]  # as EngineCore.step made them (errors go as RequestError)
    errors: list[RequestError]
    snapshot: SchedulerSnapshot


class SchedulerFailed(msgspec.Struct, tag=True, frozen=True):
    message: str  # the exception and traceback that ended the scheduler loop


class CacheFlushed(msgspec.Struct, tag=True, frozen=True):
    flush_id: int  # the FlushCache answered
    freed_blocks: int  # KV blocks the flush returned to the free pool
    error: str | None = None  # the integrity check's failure after the flush, if any


class CacheHoldsReleased(msgspec.Struct, tag=True, frozen=True):
    call_id: int  # the ReleaseCacheHolds answered
    released: int  # holds it ended (requests that held nothing count 0)


class CachePressureRead(msgspec.Struct, tag=True, frozen=True):
    call_id: int  # the ReadCachePressure answered
    pressure: CachePressure  # between steps, after every message before it was handled


FromScheduler = (
    Ready | TokenBatchOut | SchedulerFailed | CacheFlushed | CacheHoldsReleased | CachePressureRead
)
