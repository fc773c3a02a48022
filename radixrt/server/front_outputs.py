"""The front's in-flight requests and what the scheduler sends back about them: per-step
token batches (text, stop strings, deltas for the HTTP handlers, metrics) and errors.

`FrontOutputs` owns the in-flight states (by scheduler rid and by client rid) and the
scheduler's latest snapshot. `radixrt.server.front.Front` builds it, registers the requests
it sends, hands it every `TokenBatchOut` and `Ready`, and ends requests through it (client
gone, stall, scheduler gone). Its collaborators come in as callbacks: sending to the
scheduler, decoding a beam's tokens, counting a finished request for liveness and recording
a request that may hold its context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from radixrt.deltas import RequestDelta
from radixrt.detokenizer import StopRegexTimeout
from radixrt.grammar.api import SAMPLING_FIELDS
from radixrt.server.messages import (
    AbortRequest,
    Ready,
    SchedulerSnapshot,
    TokenBatchOut,
    ToScheduler,
)
from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError
from radixrt.server.request_state import BeamResult, Delta, RequestState
from radixrt.stats import EngineStats

logger = logging.getLogger("radixrt.server.front")


class FrontOutputs:
    """In-flight requests and the handling of their outputs; runs on the front's event loop
    (nothing here locks)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        send: Callable[[ToScheduler], bool],
        decode: Callable[[Sequence[int], bool], str],
        on_finished: Callable[[], None],
        record_hold: Callable[[str | None, str, str, float], None],
    ) -> None:
        """`send`: to the scheduler (False when it is unreachable); `decode(ids,
        skip_special_tokens)`: the tokenizer's text of a beam; `on_finished`: a request
        finished (not aborted); `record_hold(tenant, client_id, rid, ttl_s)`: a finished
        request may hold its context."""
        self.metrics = metrics
        self._send = send
        self._decode = decode
        self._on_finished = on_finished
        self._record_hold = record_hold
        # in-flight scheduler requests by (internal) rid: their outputs, by choice index
        self.states: dict[str, list[RequestState]] = {}
        # in flight, by (tenant, client rid): each tenant's rids are a namespace of its own
        self.by_client_rid: dict[tuple[str | None, str], list[RequestState]] = {}
        self.snapshot: SchedulerSnapshot | None = None  # the scheduler's latest state
        metrics.in_flight.set_function(lambda: len(self.states))

    # ---- requests in and out ----
    def add(
        self, groups: dict[str, list[RequestState]], client_key: tuple[str | None, str] | None
    ) -> None:
        """Register the states of the scheduler requests of one HTTP request (by rid, and by
        `client_key`: (tenant, client rid) when the client sent a rid)."""
        self.states.update(groups)
        if client_key is not None:
            self.by_client_rid[client_key] = [st for group in groups.values() for st in group]

    def unfinished(self, rid: str, tenant: str | None) -> list[RequestState]:
        """`tenant`'s unfinished outputs with this client rid, or of its one request without
        a client rid whose own id this is."""
        states = self.by_client_rid.get((tenant, rid))
        if states is None:
            group = self.states.get(rid)
            mine = group is not None and group[0].client_rid is None and group[0].tenant == tenant
            states = group if mine else []
        return [st for st in states if not st.finished]

    def fail_all(self, error: ApiError, abort: bool) -> None:
        """Fail every unfinished request with `error`; `abort`: also tell the scheduler to
        drop them (it frees their KV once it runs again)."""
        for rid, group in list(self.states.items()):
            for st in group:
                if not st.finished:
                    self.fail(st, error)
            if abort:
                self._send(AbortRequest(rid))

    def finish(self, st: RequestState, reason: str) -> None:
        st.finish_reason = reason
        self._forget(st)
        # an n > 1 request's prompt counts once (with its first choice)
        prompt, cached = (st.prompt_tokens, st.num_cached_tokens) if st.choice == 0 else (0, 0)
        self.metrics.finished(reason, prompt, cached, time.perf_counter() - st.created)

    def fail(self, st: RequestState, error: ApiError) -> None:
        st.error = error
        self._forget(st)
        self.metrics.requests.labels(finish_reason="error").inc()
        st.events.put(st, error)

    def _forget(self, st: RequestState) -> None:
        """Drop the state of a finished or failed request (every path ends here)."""
        group = self.states.get(st.rid)
        if group is not None and all(s.finished for s in group):
            del self.states[st.rid]
        if st.client_rid is not None:
            key = (st.tenant, st.client_rid)
            group = self.by_client_rid.get(key)
            if group is not None and all(s.finished for s in group):
                del self.by_client_rid[key]

    # ---- what the scheduler sends ----
    def on_ready(self, ready: Ready) -> None:
        # Nothing has run yet: every block is free. This is the state until the first
        # TokenBatchOut replaces it.
        self.snapshot = initial_snapshot(ready)
        self.metrics.update(self.snapshot)

    def on_batch(self, msg: TokenBatchOut) -> None:
        states = self.states
        new_tokens = 0
        now = time.perf_counter()  # one arrival time for the step's outputs
        for out in msg.outputs:
            group = states.get(out.parent_rid or out.rid)
            if group is not None and not group[out.index].finished:
                new_tokens += self._on_output(group[out.index], out, now)
        if new_tokens:
            self.metrics.generated_tokens.inc(new_tokens)
        for err in msg.errors:
            group = states.get(err.parent_rid or err.rid)
            if group is None:
                continue
            kind = "server_error" if err.status >= 500 else "invalid_request_error"
            if err.status >= 500:
                self.metrics.internal_errors.inc()
            # a child's error fails that choice; the request's (a 400) every choice
            for st in [group[err.index]] if err.parent_rid is not None else group:
                if not st.finished:
                    param = err.param
                    if (err.grammar or param in SAMPLING_FIELDS) and st.grammar_param:
                        param = st.grammar_param  # the field the client used
                    elif param in st.field_names:
                        param = st.field_names[param]  # e.g. max_tokens on /generate
                    error = ApiError(err.message, param, status=err.status, type=kind)
                    self.fail(st, error)
        self.snapshot = msg.snapshot
        self.metrics.update(msg.snapshot)

    def _on_output(self, st: RequestState, out: RequestDelta, now: float) -> int:
        """One step's output of one choice (arrived at `now`): its text so far, stop
        strings, the delta for its HTTP handler. Returns how many tokens it generated (for
        the step's counter)."""
        st.num_cached_tokens = out.num_cached_tokens
        st.num_draft_tokens, st.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        final = out.finish_reason is not None
        if st.beam:
            return self._on_beams(st, out)
        if final and st.params.prompt_logprobs:
            st.prompt_logprobs = list(out.prompt_logprobs)
        if st.stop_seen:  # the text is complete: what comes until the abort lands is dropped
            new_ids: Sequence[int] = []
            new_lps: list[float] = []
            new_top: list[list[tuple[int, float]]] = []
        else:  # the decoded message's own lists: nothing else holds them
            new_ids, new_lps = out.new_token_ids, out.new_logprobs
            new_top = [list(map(tuple, top)) for top in out.new_top_logprobs]
        if new_ids:
            if st.last_token_at is None:
                self.metrics.ttft.observe(now - st.created)
            else:
                self.metrics.itl.observe(now - st.last_token_at)
            st.last_token_at = now
            st.output_ids += new_ids
            if new_lps:
                st.logprobs += new_lps
            if new_top:
                st.top_logprobs += new_top
        try:
            text = st.detok.add(new_ids, final=final)
        except StopRegexTimeout as e:
            self._fail_stop_regex(st, e, final)
            return len(new_ids)
        if text:
            st.text_parts.append(text)
        if st.detok.stopped and not st.stop_seen:
            # A stop string: the text is complete. The scheduler ends the request with
            # reason "stop" and its final delta (with prompt log-probs) finishes it here.
            st.stop_seen = True
            if not final:  # this choice alone (an n > 1 request's others go on)
                index = st.choice if st.num_choices > 1 else None
                self._send(AbortRequest(st.rid, reason="stop", index=index))
        reason = None if out.finish_reason is None else out.finish_reason.value
        if reason is not None and st.stop_seen:
            reason = "stop"
        if text or new_ids or final:
            st.events.put(st, Delta(text, list(new_ids), new_lps, reason, new_top))
        if final:
            if reason != "abort":
                self._on_finished()
            if reason in ("stop", "length") and not st.stop_seen and st.options.cache_ttl_s > 0:
                # the scheduler held its context (out.rid: a child's own id) or refused to
                self._record_hold(st.tenant, st.client_id, out.rid, st.options.cache_ttl_s)
            self.finish(st, reason)
        return len(new_ids)

    def _fail_stop_regex(self, st: RequestState, e: StopRegexTimeout, final: bool) -> None:
        """A stop regex ran out of search time: the client's pattern ends this choice with
        a 400 (the scheduler drops it unless it finished already)."""
        param = st.field_names.get("stop_regex", "stop_regex")
        self.fail(st, ApiError(str(e), param))
        if not final:
            index = st.choice if st.num_choices > 1 else None
            self._send(AbortRequest(st.rid, reason="abort", index=index))

    def _on_beams(self, st: RequestState, out: RequestDelta) -> int:
        """A beam search's only output: its sequences, best first ([] when aborted)."""
        assert out.finish_reason is not None, "a beam search reports once, at its end"
        reason = out.finish_reason.value
        skip = st.params.skip_special_tokens
        st.beams = [
            BeamResult(
                self._decode(b.output_token_ids, skip),
                list(b.output_token_ids),
                b.cumulative_logprob,
                b.score,
                b.finish_reason.value,
            )
            for b in out.beams or []
        ]
        if st.beams:
            st.output_ids, st.text = st.beams[0].output_ids, st.beams[0].text
        st.events.put(st, Delta(st.text, list(st.output_ids), [], reason))
        self.finish(st, reason)
        return sum(len(b.output_ids) for b in st.beams)


def initial_snapshot(ready: Ready) -> SchedulerSnapshot:
    """The scheduler's state right after Ready: nothing running, every KV block free."""
    total = ready.kv_blocks_total
    stats = EngineStats(
        kv_blocks_total=total, kv_tokens_total=total * ready.block_size, kv_blocks_free=total
    )
    return SchedulerSnapshot(stats)
