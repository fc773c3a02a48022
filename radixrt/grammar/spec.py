"""What a constrained request asks for, as plain data (no torch, no xgrammar: the front and
the scheduler import this).

A `GrammarSpec` is (kind, text): the compile cache key. `SamplingParams.regex`, `.json_schema`
(canonical JSON text), `.grammar` (EBNF) and `.structural_tag` (xgrammar's JSON) each map to
one kind; OpenAI's
`response_format: {"type": "json_object"}` is the EBNF `JSON_OBJECT_EBNF`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")

# Any JSON object (OpenAI's json_object). Whitespace is at most one space or newline between
# tokens, so that a model cannot fill its budget with blanks.
JSON_OBJECT_EBNF = r"""root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* ws )? "}"
member ::= string ws ":" ws value
array ::= "[" ws ( value ( ws "," ws value )* ws )? "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex )
hex ::= [0-9a-fA-F]
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
ws ::= ( " " | "\n" )?
"""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    text: str  # the regex, the JSON schema (canonical JSON), the EBNF grammar or the tag

    @property
    def field(self) -> str:
        """The SamplingParams field the spec came from (for error messages)."""
        return "grammar" if self.kind == "ebnf" else self.kind


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The constraint of a SamplingParams, or None for an unconstrained request."""
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.json_schema is not None:
        return GrammarSpec("json_schema", params.json_schema)
    if params.grammar is not None:
        return GrammarSpec("ebnf", params.grammar)
    if params.structural_tag is not None:
        return GrammarSpec("structural_tag", params.structural_tag)
    return None
