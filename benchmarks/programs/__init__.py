"""The program suite: multi-call LM programs in the DSL, each also written without it.

| program | shape |
|---|---|
| mmlu | 5-shot multiple choice per subject, one decoded token per question |
| hellaswag | 20-shot context, select one of 4 endings by log-prob |
| react | ReAct agent: thought, action, observation steps on a growing context |
| gen-agents | one agent's description, then calls on different memories |
| tree-of-thought | fork candidate steps, score each with select, keep one, go deeper |
| skeleton-of-thought | skeleton, then fork N points expanded in parallel, join |
| llm-judge | branch-solve-merge: judge on k criteria in parallel, merge a verdict |
| json | extract fields as JSON under a schema |
| chat-short, chat-long | multi-turn chat with short / long answers |

Inputs are seeded words of exact token lengths and outputs are forced tokens (`text.py`),
so the calls are the same under every configuration, on any weights.
"""

from __future__ import annotations

from . import agents, branching, dialogue, fewshot
from .base import PlainLLM, ProgramSpec
from .text import Words

PROGRAMS: dict[str, ProgramSpec] = {
    p.name: p for m in (fewshot, agents, branching, dialogue) for p in m.PROGRAMS
}

__all__ = ["PROGRAMS", "PlainLLM", "ProgramSpec", "Words"]
