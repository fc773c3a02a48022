"""Beam search on the host: the state of one prompt's beams and HF's selection rule.

Matches transformers' `GenerationMixin._beam_search` (5.x, `do_sample=False`,
`early_stopping=False`, the default) step for step:

1. Rank the candidates (live beam b, token v) by cumulative log-prob `score_b + log p(v)` and
   keep the best K = max(2, 1 + number of EOS ids) * W. (The first step has one live beam: HF
   starts W copies of the prompt with scores [0, -1e9, ...].)
2. A candidate *hits a stop* when v is an EOS id or the sequence reaches max_tokens. Among the
   first W ranks, a hit is finalised with score `cumulative / length ** length_penalty`
   (length = generated tokens, EOS counted) while improvement is still possible; the W best
   finished hypotheses are kept. (`length_penalised` computes the score so that it is total
   for any finite penalty; see there.)
3. The W best candidates that did not hit a stop become the live beams.
4. Improvement stops being possible (for good) once W hypotheses are finished and the best live
   beam's cumulative log-prob / length ** length_penalty is no better than the worst of them.
   The search ends then, or when every candidate hit a stop (max_tokens).

Plain Python, no torch: the runner returns each beam's top-K log-probs (top_logprobs), which
contain every candidate of the global top K.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    """A finished beam."""

    output_token_ids: list[int]  # generated tokens (a final EOS included)
    cumulative_logprob: float  # sum of the generated tokens' log-probs
    score: float  # cumulative_logprob / len(output_token_ids) ** length_penalty
    stopped: bool = False  # ended on an EOS id (never with ignore_eos); else at max_tokens


@dataclass(frozen=True, slots=True)
class Candidate:
    beam: int  # index of the live beam it extends
    token: int
    cumulative_logprob: float  # the beam's plus log p(token)


@dataclass
class BeamState:
    width: int  # W
    num_candidates: int  # K
    max_tokens: int
    length_penalty: float
    eos_token_ids: frozenset[int]  # empty with ignore_eos
    scores: list[float] = field(default_factory=lambda: [0.0])  # live beams' cumulative
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, <= W
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    num_generated: int = 0  # tokens each live beam generated so far
    done: bool = False

    def step(
        self,
        outputs: Sequence[Sequence[int]],  # per live beam: its generated tokens
        top_logprobs: Sequence[Sequence[tuple[int, float]]],  # per live beam: its top K
    ) -> list[Candidate]:
        """Advance one token: returns the next live beams (W of them, best first), or []
        when the search is over (`done`; the result is in `finished`)."""
        assert len(outputs) == len(top_logprobs) == len(self.scores)
        ranked = sorted(
            (
                Candidate(b, tok, self.scores[b] + lp)
                for b, tops in enumerate(top_logprobs)
                for tok, lp in tops
            ),
            key=lambda c: -c.cumulative_logprob,
        )[: self.num_candidates]
        length = self.num_generated + 1

        def hits(c: Candidate) -> bool:
            return c.token in self.eos_token_ids or length >= self.max_tokens

        if self.improvable:
            new = [
                BeamHypothesis(
                    list(outputs[c.beam]) + [c.token],
                    c.cumulative_logprob,
                    length_penalised(c.cumulative_logprob, length, self.length_penalty),
                    c.token in self.eos_token_ids,
                )
                for c in ranked[: self.width]
                if hits(c)
            ]
            merged = self.finished + new
            merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            self.finished = merged[: self.width]
        live = [c for c in ranked if not hits(c)][: self.width]
        self.num_generated = length
        if self.improvable and len(self.finished) == self.width and live:
            best = length_penalised(live[0].cumulative_logprob, length, self.length_penalty)
            self.improvable = best > self.finished[-1].score
        if not live or not self.improvable:
            self.done = True
            return []
        self.scores = [c.cumulative_logprob for c in live]
        return live


# |log(length ** penalty)| up to this: length ** penalty is computed as is (a normal float64:
# e**-700 .. e**700 is inside float64's 2**-1022 .. 2**1024)
_MAX_LOG_NORM = 700.0
_LOG_MAX_FLOAT = math.log(sys.float_info.max)


def length_penalised(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """HF's hypothesis score `cumulative_logprob / length ** length_penalty`, total for any
    finite penalty. Computed as written while |log(length ** penalty)| <= _MAX_LOG_NORM, which
    holds for every |penalty| <= LENGTH_PENALTY_RANGE and length <= MAX_INT (ranking is HF's
    there); beyond, in log space, log|score| = log|cumulative| - penalty * log(length). A
    magnitude past float64's largest saturates to it, one below its smallest becomes 0. Never
    raises (no OverflowError, no ZeroDivisionError) and returns a finite number for a finite
    `cumulative_logprob`."""
    assert length >= 1
    log_norm = length_penalty * math.log(length)
    if abs(log_norm) <= _MAX_LOG_NORM:
        score = cumulative_logprob / length**length_penalty  # may overflow to inf: clamped
    elif cumulative_logprob == 0:
        score = cumulative_logprob
    else:
        log_abs = math.log(abs(cumulative_logprob)) - log_norm
        score = math.copysign(math.exp(min(log_abs, _LOG_MAX_FLOAT)), cumulative_logprob)
    return max(-sys.float_info.max, min(sys.float_info.max, score))
