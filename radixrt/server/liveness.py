"""Is the scheduler making progress? The front's view, from the messages it receives.

The scheduler process sends a `TokenBatchOut` after every loop iteration that produced
output or handled messages, and at least every `HEARTBEAT_S` while it runs steps that
produce none (long prefill chunks), so that any message is progress. The front calls the
scheduler stalled when it has work in flight and no message came for longer than the stall
timeout: a stopped process (SIGSTOP, a debugger), a deadlock, a call that never returns.
An idle scheduler with nothing in flight is healthy however long it is quiet.

The first request runs the first prefill and decode steps, which may compile kernels
(Triton, FlashInfer JIT) or autotune; until one request has finished, the longer
`warmup_timeout_s` applies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

HEARTBEAT_S = 1.0  # the scheduler's longest silence while it runs steps


@dataclass(frozen=True)
class StallPolicy:
    """How long the scheduler may go without progress while it has work."""

    # after the first finished request: within a load balancer's probe budget, and far
    # above one step (the heartbeat covers long prefill chunks)
    timeout_s: float = 30.0
    warmup_timeout_s: float = 600.0  # until then (first steps compile kernels)

    def __post_init__(self) -> None:
        if not self.timeout_s > 2 * HEARTBEAT_S:
            raise ValueError(
                f"stall timeout must be over {2 * HEARTBEAT_S:g} s (twice the scheduler's "
                f"heartbeat), got {self.timeout_s}"
            )
        if not self.warmup_timeout_s >= self.timeout_s:
            raise ValueError(
                f"the warm-up stall timeout ({self.warmup_timeout_s}) must be at least the "
                f"stall timeout ({self.timeout_s})"
            )

    @property
    def check_interval_s(self) -> float:
        """How often the front looks (a stall is noticed this much late at most)."""
        return min(1.0, self.timeout_s / 4)


class Liveness:
    """Progress tracking on the front's event loop (its only user: no locking). The front
    reports messages (`on_message`), work it sends (`on_work_sent`) and finished requests
    (`on_finished`); `check` says whether the scheduler is stalled now."""

    def __init__(self, policy: StallPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.last_progress = clock()  # the last message, or when work was sent to an idle one
        self.warm = False  # a request has finished: the first steps' compiles are done
        self.stalled_since: float | None = None  # the last progress before a reported stall

    @property
    def limit_s(self) -> float:
        return self.policy.timeout_s if self.warm else self.policy.warmup_timeout_s

    def on_message(self) -> float | None:
        """A message from the scheduler arrived. Returns how long the scheduler was silent
        when this ends a stall that was reported, else None."""
        now = self.clock()
        ended = None if self.stalled_since is None else now - self.stalled_since
        self.last_progress = now
        self.stalled_since = None
        return ended

    def on_work_sent(self, had_work: bool) -> None:
        """The front sent a request; `had_work`: other requests were in flight already (a
        scheduler that was idle starts its clock now, not at its last message)."""
        if not had_work:
            self.last_progress = max(self.last_progress, self.clock())

    def on_finished(self) -> None:
        self.warm = True

    def check(self, has_work: bool) -> float | None:
        """Seconds since the last progress when the scheduler is stalled (work in flight and
        silent past the limit, or a stall reported and not yet ended), else None. Marks a
        new stall as reported."""
        if self.stalled_since is not None:
            return self.clock() - self.stalled_since
        silence = self.clock() - self.last_progress
        if not has_work or silence <= self.limit_s:
            return None
        self.stalled_since = self.last_progress
        return silence

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    @property
    def stalled_for_s(self) -> float:
        """Seconds since the last progress of a reported stall (0.0 when not stalled)."""
        return 0.0 if self.stalled_since is None else self.clock() - self.stalled_since
