"""Structured output: regex, JSON schema and EBNF constraints (xgrammar).

Torch-free here (`spec`, `base`, `api`, and the checks run before a compile:
`regex_limits`, `json_schema_support`, which lists the JSON-schema keywords enforced): the
front and the scheduler import these. The xgrammar-backed matchers and compile cache
(`xgrammar_backend`) import xgrammar and are created by EngineCore only; compiles run in
killable worker processes (`compile_pool`, `compile_worker`). The scheduler's half is
`radixrt.scheduler.grammar`; applying bitmasks to logits is the runner's
(`radixrt.executor.grammar_masks`).
"""

from radixrt.grammar.spec import GRAMMAR_KINDS, JSON_OBJECT_EBNF, GrammarSpec, grammar_spec

__all__ = ["GRAMMAR_KINDS", "JSON_OBJECT_EBNF", "GrammarSpec", "grammar_spec"]
