"""The scheduler's requests and their queues (plain Python; the one owner of this state).

`requests` maps every live request that reports (gets deltas) and every group parent to its
`Request`; `waiting` holds requests (and group parents) in arrival order, a preempted one at
the head; `running` holds the sequences that own KV and a row slot. A group's children wait
inside their group, never in `waiting` (see `RequestGroup`).
"""

from __future__ import annotations

from collections import deque

from radixrt.scheduler.request import Request, RequestStatus


class RequestQueues:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admissions = 0  # admission order (preemption picks the newest)

    def run(self, req: Request) -> None:
        """`req` (holding its KV and slot now) starts running: newest admission."""
        req.status = RequestStatus.RUNNING
        self._admissions += 1
        req.admission_seq = self._admissions
        self.running.append(req)

    def admit(self, req: Request) -> None:
        """A waiting request from the queue starts running."""
        self.waiting.remove(req)
        self.run(req)

    def newest_running(self, exclude: list[Request]) -> Request:
        """The preemption victim: of the running sequences not in `exclude`, those of the
        least urgent priority (the highest number), the latest admitted of them."""
        taken = set(map(id, exclude))
        candidates = [r for r in self.running if id(r) not in taken]
        assert candidates, "a request needing a block is always preemptible itself"
        return max(candidates, key=lambda r: (r.priority, r.admission_seq))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def is_queued(req: Request) -> bool:
    """Whether a WAITING request sits in the waiting queue (a group's children wait inside
    their group instead)."""
    return req.group is None or req is req.group.parent
