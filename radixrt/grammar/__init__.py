"""Structured output: regex, JSON schema and EBNF constraints (xgrammar).

Torch-free here (`spec`, `base`, `scheduling`): the front and the scheduler import these. The
xgrammar-backed compiler and matchers (`xgrammar_backend`) and the mask kernel wrapper
(`masks`) import torch and xgrammar and are created by EngineCore / the runner only.
"""

from radixrt.grammar.spec import GRAMMAR_KINDS, JSON_OBJECT_EBNF, GrammarSpec, grammar_spec

__all__ = ["GRAMMAR_KINDS", "JSON_OBJECT_EBNF", "GrammarSpec", "grammar_spec"]
