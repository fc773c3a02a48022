"""LoRA's scheduler half: a step's rows use at most `max_loras` distinct adapters (the
runner's device slots), so a waiting request of another adapter waits while that many
adapters run. Every running request gets a row in a decode step, so the bound holds on the
running set. It also counts each adapter's finished requests and their tokens (the
`lora_*` fields of SchedulerCounters)."""

from __future__ import annotations

from collections import Counter

from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request
from radixrt.stats import SchedulerCounters


class LoraFeature(SchedulerFeature):
    def __init__(self, max_loras: int, queues: RequestQueues, stats: SchedulerCounters) -> None:
        self.max_loras = max_loras
        self.queues = queues
        self.stats = stats

    def running_adapters(self) -> Counter[str]:
        """Running sequences per adapter key (base rows not counted)."""
        return Counter(r.options.lora.key for r in self.queues.running if r.options.lora)

    def admissible(self, req: Request) -> bool:
        lora = req.options.lora
        if lora is None:
            return True
        running = self.running_adapters()
        return lora.key in running or len(running) < self.max_loras

    def on_finish(self, req: Request) -> None:
        """Count a finished request that reports to its client (not an n > 1 parent or a
        beam) under its adapter's name."""
        lora = req.options.lora
        if lora is None or not req.reports:
            return
        s, name = self.stats, lora.name
        s.lora_requests = {**s.lora_requests, name: s.lora_requests.get(name, 0) + 1}
        s.lora_prompt_tokens = {
            **s.lora_prompt_tokens,
            name: s.lora_prompt_tokens.get(name, 0) + req.prompt_len,
        }
        s.lora_generated_tokens = {
            **s.lora_generated_tokens,
            name: s.lora_generated_tokens.get(name, 0) + req.num_output,
        }

    def check_integrity(self) -> None:
        assert len(self.running_adapters()) <= self.max_loras
