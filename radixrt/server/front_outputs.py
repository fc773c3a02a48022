"""The front's handling of what the scheduler sends: per-step token batches (text, stop
strings, deltas for the HTTP handlers, metrics), errors, Ready and the scheduler's failure.

`FrontOutputs` is a mixin of `radixrt.server.front.Front` (it uses the front's `states`,
`by_client_rid`, `held`, `calls`, `metrics`, `tokenizer`, `from_scheduler`, `liveness`,
`_send`, `_on_progress` and `stop_serving`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from radixrt.grammar.api import SAMPLING_FIELDS
from radixrt.server.messages import (
    AbortRequest,
    CacheFlushed,
    CacheHoldsReleased,
    CachePressureRead,
    FromScheduler,
    Ready,
    SchedulerFailed,
    SchedulerSnapshot,
    TokenBatchOut,
    TokenOut,
)
from radixrt.server.protocol import ApiError
from radixrt.server.request_state import BeamResult, Delta, RequestState
from radixrt.stats import EngineStats

logger = logging.getLogger("radixrt.server.front")


class FrontOutputs:
    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.from_scheduler.recv_async()
                self._on_progress()
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("front failed to handle a scheduler message")
            self.stop_serving(f"the front failed to read scheduler output ({e!r})")

    def _dispatch(self, msg: FromScheduler) -> None:
        if isinstance(msg, TokenBatchOut):
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
                        self._fail(st, error)
            self.snapshot = msg.snapshot
            self.metrics.update(msg.snapshot)
        elif isinstance(msg, Ready):
            self.ready = msg
            # Nothing has run yet: every block is free. This is the state until the first
            # TokenBatchOut replaces it.
            self.snapshot = initial_snapshot(msg)
            self.metrics.update(self.snapshot)
            logger.info(
                "scheduler ready (pid %d): max_model_len=%d, vocab=%d, %d KV blocks",
                msg.pid, msg.max_model_len, msg.vocab_size, msg.kv_blocks_total,
            )  # fmt: skip
            self._check_ready()
        elif isinstance(msg, (CacheFlushed, CacheHoldsReleased, CachePressureRead)):
            if isinstance(msg, CachePressureRead):
                # read after every request recorded so far had finished (and held or not)
                self.held.keep_only(msg.pressure.held)
            future = self.calls.get(msg.flush_id if isinstance(msg, CacheFlushed) else msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, SchedulerFailed):
            last = msg.message.strip().splitlines()[-1]
            self.stop_serving(f"the scheduler process failed ({last})")

    def _check_ready(self) -> None:
        if self.serving:
            self.metrics.ready.set(1)
            self.ready_event.set()

    def _on_output(self, st: RequestState, out: TokenOut, now: float) -> int:
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
            new_ids, new_lps = out.new_ids, out.new_logprobs
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
        text = st.detok.add(new_ids, final=final)
        if text:
            st.text_parts.append(text)
        if st.detok.stopped and not st.stop_seen:
            # A stop string: the text is complete. The scheduler ends the request with
            # reason "stop" and its final TokenOut (with prompt log-probs) finishes it here.
            st.stop_seen = True
            if not final:  # this choice alone (an n > 1 request's others go on)
                index = st.choice if st.num_choices > 1 else None
                self._send(AbortRequest(st.rid, reason="stop", index=index))
        reason = out.finish_reason
        if reason is not None and st.stop_seen:
            reason = "stop"
        if text or new_ids or final:
            st.events.put(st, Delta(text, list(new_ids), new_lps, reason, new_top))
        if final:
            if reason != "abort":
                self.liveness.on_finished()
            if reason in ("stop", "length") and not st.stop_seen and st.params.cache_ttl_s > 0:
                # the scheduler held its context (out.rid: a child's own id) or refused to
                self.held.add(st.tenant, st.client_id, out.rid, st.params.cache_ttl_s)
            self._finish(st, reason)
        return len(new_ids)

    def _on_beams(self, st: RequestState, out: TokenOut) -> int:
        """A beam search's only output: its sequences, best first ([] when aborted)."""
        assert out.finish_reason is not None, "a beam search reports once, at its end"
        skip = st.params.skip_special_tokens
        st.beams = [
            BeamResult(
                self.tokenizer.decode(b.output_ids, skip_special_tokens=skip),
                list(b.output_ids),
                b.cumulative_logprob,
                b.score,
                b.finish_reason,
            )
            for b in out.beams
        ]
        if st.beams:
            st.output_ids, st.text = st.beams[0].output_ids, st.beams[0].text
        st.events.put(st, Delta(st.text, list(st.output_ids), [], out.finish_reason))
        self._finish(st, out.finish_reason)
        return sum(len(b.output_ids) for b in st.beams)

    def _finish(self, st: RequestState, reason: str) -> None:
        st.finish_reason = reason
        self._forget(st)
        # an n > 1 request's prompt counts once (with its first choice)
        prompt, cached = (st.prompt_tokens, st.num_cached_tokens) if st.choice == 0 else (0, 0)
        self.metrics.finished(reason, prompt, cached, time.perf_counter() - st.created)

    def _fail(self, st: RequestState, error: ApiError) -> None:
        st.error = error
        self._forget(st)
        self.metrics.requests.labels(finish_reason="error").inc()
        st.events.put(st, error)

    def _forget(self, st: RequestState) -> None:
        """Drop the front's state of a finished or failed request (every path ends here)."""
        group = self.states.get(st.rid)
        if group is not None and all(s.finished for s in group):
            del self.states[st.rid]
        if st.client_rid is not None:
            group = self.by_client_rid.get(st.client_rid)
            if group is not None and all(s.finished for s in group):
                del self.by_client_rid[st.client_rid]


def initial_snapshot(ready: Ready) -> SchedulerSnapshot:
    """The scheduler's state right after Ready: nothing running, every KV block free."""
    total = ready.kv_blocks_total
    stats = EngineStats(
        kv_blocks_total=total, kv_tokens_total=total * ready.block_size, kv_blocks_free=total
    )
    return SchedulerSnapshot(stats)
