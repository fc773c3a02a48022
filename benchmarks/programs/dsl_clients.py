"""DSL backends of the suite: a recording wrapper over a real backend, the ablation
wrappers (no frontend hints, no frontend parallelism) and a dry backend that runs the
programs without a model (their calls and working set before any engine starts)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from radixrt.frontend import Backend, GenResult
from radixrt.frontend.chat import ChatTemplate
from radixrt.frontend.interpreter import program_hold_s
from radixrt.sampling import DEFAULT_OPTIONS, SamplingParams

from .accounting import Call, CallLog
from .base import ProgramSpec


class Wrapper(Backend):
    """A backend that forwards to `inner` (tokenizer and chat template included)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.releases_holds = inner.releases_holds
        self.holds_back_shared_prefixes = inner.holds_back_shared_prefixes

    @property
    def chat_template(self) -> ChatTemplate:  # type: ignore[override]
        return self.inner.chat_template

    def generate(self, prompt_ids, params, on_delta=None, options=DEFAULT_OPTIONS) -> GenResult:
        return self.inner.generate(prompt_ids, params, on_delta, options=options)

    def score_continuations(self, prefix_ids, continuations, cache_salt=None) -> list[list[float]]:
        return self.inner.score_continuations(prefix_ids, continuations, cache_salt)

    def release_cache_holds(self, rids: list[str]) -> None:
        self.inner.release_cache_holds(rids)

    def cache_pressure(self):
        return self.inner.cache_pressure()


class Recording(Wrapper):
    """Records every request in `log` (send order), as the engine will count it."""

    def __init__(self, inner: Backend, log: CallLog) -> None:
        super().__init__(inner)
        self.log = log

    def generate(self, prompt_ids, params, on_delta=None, options=DEFAULT_OPTIONS) -> GenResult:
        slot = self.log.reserve()
        result = self.inner.generate(prompt_ids, params, on_delta, options=options)
        kind = "gen" if params.max_tokens else "hint"
        ids = tuple(prompt_ids)
        self.log.put(slot, Call(kind, ids, params.max_tokens or 0, len(ids) - 1,
                                tuple(result.output_ids)))  # fmt: skip
        return result

    def score_continuations(self, prefix_ids, continuations, cache_salt=None) -> list[list[float]]:
        slot = self.log.reserve(len(continuations))
        scores = self.inner.score_continuations(prefix_ids, continuations, cache_salt)
        limit = max(1, len(prefix_ids)) - 1  # the log-probs from the prefix's end are computed
        for k, cont in enumerate(continuations):
            self.log.put(slot + k, Call("score", tuple(prefix_ids) + tuple(cont), 0, limit))
        return scores


class NoHints(Wrapper):
    """No frontend hints: prefixes are never sent ahead (forks, select, run_batch) and a
    program does not hold its context between its calls (no retention hint)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.releases_holds = False  # so programs send no retention hint of their own

    def cache_prefix(
        self, prompt_ids: list[int], cache_salt: str | None = None, cache_ttl_s: float = 0.0
    ) -> GenResult:
        return GenResult("", [], "length", len(prompt_ids), 0, 0)


class Serial(Wrapper):
    """No frontend parallelism: one program's requests go one at a time (its forks run
    one after another). One instance per program run."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()

    def generate(self, prompt_ids, params, on_delta=None, options=DEFAULT_OPTIONS) -> GenResult:
        with self._lock:
            return self.inner.generate(prompt_ids, params, on_delta, options=options)

    def score_continuations(self, prefix_ids, continuations, cache_salt=None) -> list[list[float]]:
        with self._lock:
            return self.inner.score_continuations(prefix_ids, continuations, cache_salt)


class Dry(Backend):
    """No model: a gen returns its biased token max_tokens times (what the engine emits),
    an unbiased one (a grammar's) max_tokens copies of the first word; scores are 0."""

    def __init__(self, tokenizer, filler_token: int) -> None:
        self.tokenizer = tokenizer
        self.filler_token = filler_token

    def generate(
        self, prompt_ids, params: SamplingParams, on_delta=None, options=DEFAULT_OPTIONS
    ) -> GenResult:
        n = params.max_tokens or 0
        token = params.logit_bias[0][0] if params.logit_bias else self.filler_token
        ids = [token] * n
        return GenResult(self.tokenizer.decode(ids), ids, "length", len(prompt_ids), n, 0)

    def score_continuations(self, prefix_ids, continuations, cache_salt=None) -> list[list[float]]:
        return [[0.0] * len(c) for c in continuations]


def run_dsl(
    spec: ProgramSpec,
    inputs: Sequence[dict],
    backend: Backend,
    *,
    threads: int,
    hints: bool = True,
    parallel: bool = True,
    admission: bool = True,
) -> None:
    """Run the program on every input, `threads` at a time: `run_batch` (with its shared
    prefix hint when `hints`, its program admission when `admission`), or, without frontend
    parallelism, each program through its own `Serial` backend after the same batch hint."""
    if not hints:
        backend = NoHints(backend)
    if parallel:
        spec.dsl.run_batch(
            list(inputs),
            backend=backend,
            num_threads=threads,
            prefix_hint=hints,
            admission=admission,
        )
        return
    held = []  # the shared prefix, held while the programs run (as run_batch does)
    if hints and len(inputs) > 1:
        prefix = common_prefix([backend.encode(spec.dsl.trace_prefix(backend, None, kw))
                                for kw in inputs])  # fmt: skip
        if prefix:
            hold_s = program_hold_s(backend, None)
            sent = backend.cache_prefix(prefix, None, hold_s)
            held += [sent.rid] if hold_s > 0 and sent.rid is not None else []
    try:
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(spec.dsl.run, backend=Serial(backend), **kw) for kw in inputs]:
                f.result()
    finally:
        if held:
            backend.release_cache_holds(held)


def common_prefix(seqs: Sequence[list[int]]) -> list[int]:
    common = seqs[0]
    for ids in seqs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, ids)) if a != b), None)
        common = common[: min(len(common), len(ids)) if n is None else n]
    return common
