"""Load or recompute: whether a prefix's pages are worth reading from the storage tier.

Reading k pages costs about `fetch_latency + k * page_bytes / read_bandwidth`; computing their
k * block_size tokens costs `tokens / prefill_throughput`. Loading pays only when the first is
smaller, which depends on the disk or store, the model's KV bytes per token and the device, so
every rate is measured here rather than assumed: the read bandwidth and the per-fetch latency
from the runner's timings of each fetch (`FetchDone`), the prefill throughput from the
scheduler's durations of steps that computed many prompt tokens (the per-step cost in them
makes it a slight underestimate, which leans towards loading). Each is a ratio of
exponentially decayed sums (a new sample weighs 1, the older ones `DECAY` times less per
sample), so large samples weigh by their size.

Policy `auto` decides per prefix; `always` loads every prefix (the tier's behaviour without a
cost model) and `never` computes every prefix (storage is written, never read). Under `auto`,
a prefix is loaded while a rate it needs is unmeasured (a fetch is how they are learned), and
every `PROBE_EVERY`-th prefix left to compute is still fetched without anyone waiting for it,
so a store that became faster is noticed. Plain Python (no torch).
"""

from __future__ import annotations

import enum

from radixrt.config import LOAD_POLICIES

DECAY = 0.8  # weight of the older samples against each new one
SEED_READ_BANDWIDTH = 256.0 * 2**20  # bytes/s until a read is timed: below local disks'
SEED_FETCH_LATENCY_S = 0.005  # seconds until a fetch is timed: a network store's order
LOAD_MARGIN = 1.0  # load when load time x this <= recompute time
PROBE_EVERY = 32  # recompute decisions between fetches made only to measure storage
# a step computing fewer prompt tokens is mostly fixed per-step cost, not prefill throughput
MIN_PREFILL_SAMPLE_TOKENS = 128


class Choice(enum.Enum):
    LOAD = "load"  # fetch the pages; the request waits for them (bounded)
    RECOMPUTE = "recompute"  # no fetch; the request computes its prefix
    PROBE = "probe"  # the request computes, a fetch runs beside it to measure storage


class DecayedRatio:
    """`amount / seconds` over exponentially decayed sums of samples; `seed` until the
    first sample."""

    def __init__(self, seed: float | None = None) -> None:
        self.seed = seed
        self.samples = 0
        self._amount = 0.0
        self._seconds = 0.0

    def add(self, amount: float, seconds: float) -> None:
        """One sample (ignored unless `seconds` > 0)."""
        if not seconds > 0:
            return
        self._amount = self._amount * DECAY + amount
        self._seconds = self._seconds * DECAY + seconds
        self.samples += 1

    @property
    def value(self) -> float | None:
        return self._amount / self._seconds if self.samples else self.seed


class StorageCostModel:
    """The measured rates and the per-prefix decision (see the module docstring)."""

    def __init__(self, policy: str = "auto") -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(
                f"kv_storage_load_policy must be one of {', '.join(LOAD_POLICIES)}, got {policy!r}"
            )
        self.policy = policy
        self.read_bandwidth = DecayedRatio(SEED_READ_BANDWIDTH)  # bytes per second of `get`
        # seconds per fetch of the `exists` call (a round trip that moves no page)
        self.fetch_latency = DecayedRatio(SEED_FETCH_LATENCY_S)
        self.prefill_throughput = DecayedRatio()  # prompt tokens per second of step
        self.page_bytes = 0  # learned from the first fetch (0: no fetch ended yet)
        self._recomputes_since_probe = 0

    # ---- measurements ----
    def observe_fetch(self, num_pages: int, page_bytes: int, lookup_s: float, read_s: float):
        """A finished fetch read `num_pages` pages of `page_bytes` in `read_s` seconds after
        a lookup of `lookup_s`."""
        if page_bytes:
            self.page_bytes = page_bytes
        self.fetch_latency.add(lookup_s, 1.0 if lookup_s > 0 else 0.0)
        if num_pages:
            self.read_bandwidth.add(num_pages * page_bytes, read_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` prompt tokens and took `seconds` (a sample when it
        computed at least `MIN_PREFILL_SAMPLE_TOKENS`)."""
        if num_tokens >= MIN_PREFILL_SAMPLE_TOKENS:
            self.prefill_throughput.add(num_tokens, seconds)

    # ---- estimates ----
    def load_seconds(self, num_pages: int) -> float:
        """Expected seconds to read `num_pages` pages (needs `page_bytes`)."""
        return self.fetch_latency.value + num_pages * self.page_bytes / self.read_bandwidth.value

    def recompute_seconds(self, num_tokens: int) -> float:
        """Expected seconds to prefill `num_tokens` (needs a prefill sample). Linear: the
        attention's quadratic term is ignored, which undercounts long prefixes' cost."""
        return num_tokens / self.prefill_throughput.value

    def decide(self, num_pages: int, num_tokens: int) -> Choice:
        """Whether to load `num_pages` pages holding `num_tokens` prompt tokens or compute
        them. Counts recompute decisions for the probes (mutates)."""
        if self.policy == "always":
            return Choice.LOAD
        if self.policy == "never":
            return Choice.RECOMPUTE
        if not self.page_bytes or not self.prefill_throughput.samples:
            return Choice.LOAD  # unmeasured: a fetch measures
        if self.load_seconds(num_pages) * LOAD_MARGIN <= self.recompute_seconds(num_tokens):
            return Choice.LOAD
        self._recomputes_since_probe += 1
        if self._recomputes_since_probe >= PROBE_EVERY:
            self._recomputes_since_probe = 0
            return Choice.PROBE
        return Choice.RECOMPUTE
