"""What one engine step produced for one request: `RequestDelta`, the one struct that
`EngineCore.step` returns, the in-process `Engine` reads and the scheduler process sends to the
front as it is (msgpack, inside `radixrt.server.messages.TokenBatchOut`). Torch-free and
scheduler-free, so that the front can decode it.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string (the front / Engine aborts)
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"  # the engine failed this request (a bug or a failed step: `Request.error`)


class BeamOut(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One finished beam-search sequence."""

    output_token_ids: list[int]  # generated tokens (a final EOS included)
    cumulative_logprob: float  # sum of their log-probs
    score: float  # cumulative_logprob / len(output_token_ids) ** length_penalty
    finish_reason: FinishReason = FinishReason.LENGTH  # STOP: it ended with an EOS id


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """One request's progress in one step (only requests that changed get one). A child of an
    n > 1 request reports as itself (`rid` its own id, `fork_rid(parent_rid, index)`) with
    `parent_rid` the id it was added with and `index` its choice 0..n-1; a beam search reports
    once, at the end, with `beams`.

    Sent as an array, not a map (one per running row per step: several times smaller and
    faster to code than a map); both ends run the same code. Errors reach the front as
    `RequestError`s, so the error fields are read in-process only."""

    rid: str
    new_token_ids: list[int]  # output tokens since the previous delta
    finish_reason: FinishReason | None  # set on the request's last delta
    prompt_tokens: int
    num_output_tokens: int  # output tokens so far
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    new_logprobs: list[float] = []  # log-probs of new_token_ids (when params.logprobs)
    # when params.logprobs and params.top_logprobs > 0: per id of new_token_ids, the
    # params.top_logprobs most likely (token id, log-prob) pairs, most likely first
    new_top_logprobs: list[list[tuple[int, float]]] = []
    # when params.prompt_logprobs, on the last delta only: prompt tokens
    # [logprob_start_len, prompt_tokens)
    prompt_logprobs: list[float] = []
    parent_rid: str | None = None  # n > 1: the id the request was added with
    index: int = 0  # n > 1: the child's index (choice), 0..n-1
    # speculative decoding, for the request so far: drafts verified, and of those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    beams: list[BeamOut] | None = None  # beam search: on the last delta, best first
    error: str | None = None  # with FinishReason.ERROR: what failed
    invalid_request: bool = False  # with ERROR: the request's fault (bad grammar): a 400
    error_param: str | None = None  # with invalid_request: the SamplingParams field at fault
    unavailable: bool = False  # with ERROR: a part it needs is down (a 503)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
