"""Structured output: regex, JSON schema and EBNF constraints (xgrammar).

Torch-free here (`spec`, `base`): the front and the scheduler import these. The
xgrammar-backed compiler and matchers (`xgrammar_backend`) import xgrammar and are created by
EngineCore only. The scheduler's half is `radixrt.scheduler.grammar`; applying bitmasks to
logits is the runner's (`radixrt.engine.grammar_masks`).
"""

from radixrt.grammar.spec import GRAMMAR_KINDS, JSON_OBJECT_EBNF, GrammarSpec, grammar_spec

__all__ = ["GRAMMAR_KINDS", "JSON_OBJECT_EBNF", "GrammarSpec", "grammar_spec"]
