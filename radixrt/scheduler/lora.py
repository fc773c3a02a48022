"""LoRA's scheduler half: a step's rows use at most `max_loras` distinct adapters (the
runner's device slots), so a waiting request of another adapter waits while that many
adapters run. Every running request gets a row in a decode step, so the bound holds on the
running set."""

from __future__ import annotations

from collections import Counter

from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request


class LoraFeature(SchedulerFeature):
    def __init__(self, max_loras: int, queues: RequestQueues) -> None:
        self.max_loras = max_loras
        self.queues = queues

    def running_adapters(self) -> Counter[str]:
        """Running sequences per adapter key (base rows not counted)."""
        return Counter(r.params.lora.key for r in self.queues.running if r.params.lora)

    def admissible(self, req: Request) -> bool:
        lora = req.params.lora
        if lora is None:
            return True
        running = self.running_adapters()
        return lora.key in running or len(running) < self.max_loras

    def check_integrity(self) -> None:
        assert len(self.running_adapters()) <= self.max_loras
