"""Plans in flight (plain Python): a plan made by `Scheduler.schedule` counts as in flight
(`Launched`: each row's request and incarnation) until `Scheduler.update` applies its result or
`Scheduler.fail_step` fails its requests.

Overlap: `schedule()` may run while earlier plans are still executing (their results not
applied). A row sampled by a step in flight counts as one more token (`num_inflight_samples`)
whose value the next decode step reads on the device; stop conditions are checked when the
result arrives, and a request found finished then has the extra step's token dropped. A request
that is aborted, finished or preempted while in flight frees its KV at once; results of that
step for it are ignored. Freed blocks and slots are reused only by later plans, which a runner
executes after the earlier ones (one stream), so no step reads a block after another reused it
and a slot's new entry lands after the old step's device updates. Rows that need their result
on the host before the next plan (verify rows, grammar masks, beams) are not planned again
until it arrives; penalised rows do not wait (the runner counts their samples per slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixrt.cache.tiers import unmade_blocks
from radixrt.plan import BlockOp, StepPlan
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, RequestStatus


@dataclass
class Launched:
    """Scheduler-side record of a plan in flight: which request (and incarnation) each row
    belongs to."""

    requests: list[Request]
    epochs: list[int]
    block_ops: list[BlockOp]  # the plan's (a failed earlier plan may have left them wrong inputs)
    has_verify_rows: bool  # rows with drafts (their next row starts where acceptance ends)
    prompt_tokens: int = 0  # prompt tokens its rows compute
    launched_at: float = 0.0  # the scheduler's clock when it was planned


class InFlight:
    """The plans made and not applied yet, by step id in launch order."""

    def __init__(self) -> None:
        self._launched: dict[int, Launched] = {}

    def __len__(self) -> int:
        return len(self._launched)

    @property
    def has_verify_rows(self) -> bool:
        """Whether a plan in flight has rows with drafts."""
        return any(launched.has_verify_rows for launched in self._launched.values())

    def launch(self, step_id: int, launched: Launched) -> None:
        self._launched[step_id] = launched

    def pop(self, step_id: int) -> Launched:
        return self._launched.pop(step_id)

    def block_ops_after(self, step_id: int) -> list[list[BlockOp]]:
        """The block ops of the plans launched after `step_id`, in launch order."""
        return [self._launched[i].block_ops for i in sorted(self._launched) if i > step_id]


def discard_unmade_copies(
    plan: StepPlan,
    later: list[list[BlockOp]],
    kv: KVManager,
    queues: RequestQueues,
    lifecycle: Lifecycle,
    on_kv_lost: list[Callable[[Callable[[Any], bool]], None]],
) -> None:
    """The failed `plan` may have run none, some or all of its block ops: the blocks they
    write, and what `later` plans (and ops queued since) copied from those, hold unknown
    content. Requests holding such a device block or locking a node that loses a copy are
    preempted (they recompute, or load again from a valid host copy), the features drop what
    rests on such a path (`on_kv_lost`); then the cache forgets those copies, so no node
    claims KV that may never have been copied."""
    tiered = kv.host_cache
    assert tiered is not None and tiered.host is not None, "swap ops without a host tier"
    host = tiered.host
    later = [*later, kv.pending_ops + host.pending_ops]  # they run next, in this order
    device_blocks, host_blocks = unmade_blocks(plan.block_ops, later)
    stale = {id(n) for n in tiered.stale_nodes(device_blocks, host_blocks)}

    def on_lost_path(handle: Any) -> bool:
        return _on_path(handle, stale)

    for req in list(queues.running):
        if req.status is RequestStatus.RUNNING and (
            not device_blocks.isdisjoint(req.block_table) or on_lost_path(req.cache_handle)
        ):
            lifecycle.preempt(req)
    for hook in on_kv_lost:
        hook(on_lost_path)
    tiered.discard_copies(device_blocks, host_blocks)
    host.uncount(plan.block_ops)


def _on_path(handle: Any, nodes: set[int]) -> bool:
    """Whether a node of the radix path root..handle is in `nodes` (ids)."""
    while handle is not None:
        if id(handle) in nodes:
            return True
        handle = handle.parent
    return False
