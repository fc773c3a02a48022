"""Per-output state in the front, and `Generation`: the outputs of one HTTP call.

One scheduler request per prompt: an n > 1 request has n `RequestState`s (its choices, one
detokenizer and stop-string matcher each) that share its `rid`; a beam search has one, whose
`beams` arrive when the search ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams
from radixrt.server.protocol import ApiError


@dataclass
class Delta:
    """New output of one request."""

    text: str  # new text, safe to show (stop strings excluded)
    token_ids: list[int]  # new token ids
    logprobs: list[float]  # their log-probs (when asked)
    finish_reason: str | None  # set on the request's last delta
    # per new token (when top log-probs were asked): [(token id, log-prob)], most likely first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class BeamResult:
    """One finished beam-search sequence, as the client gets it."""

    text: str
    output_ids: list[int]  # generated tokens (a final EOS included)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(output_ids) ** length_penalty
    finish_reason: str  # "stop" (ended with EOS) | "length"


@dataclass(eq=False)
class RequestState:
    rid: str  # the front's id of the scheduler request (n > 1: shared by its choices)
    index: int  # position in its HTTP request: input i, choice j -> i * n + j
    prompt_ids: list[int]
    params: SamplingParams  # this choice's (n = 1, seed + choice)
    detok: IncrementalDetokenizer
    events: Outbox  # shared by the HTTP request: (state, Delta | ApiError)
    client_rid: str | None  # the client's rid (opaque): echoed back, /abort takes it
    choice: int = 0  # the child index inside its scheduler request (0..n-1)
    num_choices: int = 1  # n of its scheduler request (1 for a beam search)
    beam: bool = False  # a beam search: no deltas but the last, results in `beams`
    grammar_param: str | None = None  # the request field holding its constraint, if any
    options: RequestOptions = DEFAULT_OPTIONS  # as sent: salt, priority, retention, adapter
    # the request's names of the engine's `max_tokens` / `prompt` (for the scheduler's errors)
    field_names: dict[str, str] = field(default_factory=dict)
    tenant: str | None = None  # whose API key made the request (None: no tenants)
    beams: list[BeamResult] = field(default_factory=list)  # beam search: best first
    created: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)  # the text so far, as it came
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    stop_seen: bool = False  # a stop string ended the text; the scheduler's abort is pending
    finish_reason: str | None = None
    error: ApiError | None = None

    @property
    def client_id(self) -> str:
        """The id the client knows the request by (/generate's `meta_info["id"]`): its
        `rid`, else the front's id of the scheduler request."""
        return self.rid if self.client_rid is None else self.client_rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def text(self) -> str:
        """The output text so far (joined on demand: appending a step's text stays O(new))."""
        if len(self.text_parts) > 1:
            self.text_parts = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self.text_parts = [value]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


class Outbox:
    """The events of one HTTP call's outputs, (state, Delta | ApiError), in order. The
    front puts every output of a scheduler step; the handler, woken once, takes all that is
    pending: one wake-up and one write per HTTP call per step however many outputs it has,
    and fewer, larger writes (not a burst of small ones) when the handler falls behind."""

    def __init__(self) -> None:
        self._items: list[tuple[RequestState, Delta | ApiError]] = []
        self._waiter: asyncio.Future | None = None

    def put(self, st: RequestState, item: Delta | ApiError) -> None:
        self._items.append((st, item))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[tuple[RequestState, Delta | ApiError]]:
        """Everything put since the last take (waits for at least one event)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def merge_deltas(deltas: list[Delta]) -> Delta:
    """One delta with the text, tokens and log-probs of consecutive deltas of one output."""
    if len(deltas) == 1:
        return deltas[0]
    return Delta(
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        [lp for d in deltas for lp in d.logprobs],
        deltas[-1].finish_reason,
        [top for d in deltas for top in d.top_logprobs],
    )


class Generation:
    """The requests of one HTTP call. Use as `async with`; exiting aborts unfinished ones."""

    def __init__(
        self,
        states: list[RequestState],
        events: Outbox,
        abort: Callable[[list[RequestState]], None],
    ) -> None:
        self.states = states  # in index order
        self._events = events
        self._abort = abort  # ends these outputs now (client gone)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        unfinished = [st for st in self.states if not st.finished]
        if unfinished:
            self._abort(unfinished)

    async def batches(self) -> AsyncIterator[list[tuple[RequestState, Delta]]]:
        """What arrived since the last batch: one delta per output that has new output
        (several steps' deltas merged), outputs in the order their deltas came. Raises the
        ApiError of a failed output (after a batch with the deltas that came before it)."""
        remaining = len(self.states)
        while remaining:
            pending: dict[RequestState, list[Delta]] = {}
            error = None
            for st, item in await self._events.take():
                if isinstance(item, ApiError):
                    error = item
                    break
                pending.setdefault(st, []).append(item)
            batch = [(st, merge_deltas(ds)) for st, ds in pending.items()]
            remaining -= sum(1 for _, d in batch if d.finish_reason is not None)
            if batch:
                yield batch
            if error is not None:
                raise error

    async def wait(self) -> list[RequestState]:
        """Wait until every request finished; returns them in index order."""
        async for _ in self.batches():
            pass
        return self.states
