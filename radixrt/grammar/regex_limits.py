"""Complexity limits of a regex, checked before it is compiled (plain Python, no xgrammar).

xgrammar turns a regex into a grammar whose compile time grows about with the cube of the
longest run of consecutive optional items in one sequence: `(a|b|c|d)?` repeated 300 times
compiles for seconds, 3,000 times for minutes, while `(a|b|c|d){0,300}` or 300 items that
are not optional compile at once. `check_regex` estimates that run (and the nesting of
groups) from the regex text and refuses a regex over the limits before any compile starts;
the compile time limit of `radixrt.grammar.compile_pool` stops what the estimate misses.

An item counts as optional when it may match the empty string: `x?`, `x*`, `x{0,n}`, a
group with an empty or optional alternative. Anchors (`^`, `$`) are not items. The estimate
is conservative (some optional forms xgrammar compiles fast count too); the limits are far
above what hand-written patterns use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_OPTIONAL_RUN = 64  # consecutive optional items in one sequence at most
MAX_GROUP_NESTING = 32  # groups inside groups at most


# the `regex` module's fuzzy-matching constraints: `{e}`, `{e<=2}`, `{i<=1,d<=1}`, `{2i+1s<=3}`
_FUZZY = re.compile(r"(?<!\\)\{[\d\s<=,+eisd]*[eisd][\d\s<=,+eisd]*(?::[^{}]*)?\}")


def check_not_fuzzy(regex: str, what: str = "regex") -> None:
    """Raise ValueError when `regex` uses fuzzy matching (its search cost grows with the
    allowed errors times the text, far beyond what plain patterns cost)."""
    m = _FUZZY.search(regex)
    if m is not None:
        raise ValueError(
            f"{what} uses fuzzy matching ({m.group()[:40]!r}), which is not supported; "
            "escape a literal brace as \\{"
        )


@dataclass(frozen=True, slots=True)
class RegexCost:
    longest_optional_run: int  # consecutive optional items in one sequence, at most
    max_nesting: int  # deepest group nesting


def check_regex(regex: str, what: str = "regex") -> None:
    """Raise ValueError when `regex` is over a limit; `what` names it in the message (the
    request field, or where in a JSON schema the pattern is)."""
    cost = regex_cost(regex)
    if cost.longest_optional_run > MAX_OPTIONAL_RUN:
        raise ValueError(
            f"{what} is too complex to compile: {cost.longest_optional_run} consecutive "
            f"optional items (like `x?`, `x*`, `(x|)`) in one sequence; at most "
            f"{MAX_OPTIONAL_RUN} are allowed (a bounded repeat such as `x{{0,n}}` counts once)"
        )
    if cost.max_nesting > MAX_GROUP_NESTING:
        raise ValueError(
            f"{what} is too complex to compile: groups nested {cost.max_nesting} deep; at "
            f"most {MAX_GROUP_NESTING} levels are allowed"
        )


def regex_cost(regex: str) -> RegexCost:
    """The estimate of the module docstring. Never raises: a malformed regex gets some
    estimate (the compile then reports what is wrong with it)."""
    scan = _Scan(regex)
    while scan.pos < len(regex):  # an unmatched ')' ends a top-level alternation
        scan.alternation(0)
        scan.pos += 1
    return RegexCost(scan.longest_run, scan.max_nesting)


@dataclass(frozen=True, slots=True)
class _Seq:
    """One sequence of items, as its neighbours see it when it is inlined."""

    nullable: bool  # every item is optional
    head_run: int  # optional items at its start
    tail_run: int  # optional items at its end
    length: int  # its items (an inlined group's items counted one by one)


class _Scan:
    """Recursive descent over the regex: alternation := sequence ('|' sequence)*,
    sequence := (atom quantifier?)*, atom := group | class | escape | char. A group with one
    alternative and no quantifier is inlined into its sequence (xgrammar does so too): runs
    of optional items continue through it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.longest_run = 0
        self.max_nesting = 0

    def alternation(self, depth: int) -> list[_Seq]:
        """Parse up to an unmatched ')' or the end: its sequences."""
        seqs = [self.sequence(depth)]
        while self.pos < len(self.text) and self.text[self.pos] == "|":
            self.pos += 1
            seqs.append(self.sequence(depth))
        return seqs

    def sequence(self, depth: int) -> _Seq:
        text = self.text
        run = length = 0
        head: int | None = None  # the run before the first required item
        while self.pos < len(text) and text[self.pos] not in "|)":
            if text[self.pos] in "^$":  # anchors: not items
                self.pos += 1
                continue
            group = self.atom(depth)
            min_count = self.quantifier()
            if isinstance(group, list) and len(group) == 1 and min_count is None:
                inner = group[0]  # inlined
                length += inner.length
                if inner.nullable:
                    run += inner.length
                else:
                    run += inner.head_run
                    self.longest_run = max(self.longest_run, run)
                    head = run if head is None else head
                    run = inner.tail_run
            else:
                length += 1
                nullable = min_count == 0 or (
                    isinstance(group, list) and any(s.nullable for s in group)
                )
                if nullable:
                    run += 1
                else:
                    head = run if head is None else head
                    run = 0
            self.longest_run = max(self.longest_run, run)
        if head is None:
            return _Seq(True, run, run, length)
        return _Seq(False, head, run, length)

    def atom(self, depth: int) -> list[_Seq] | None:
        """Consume one atom: a group's sequences, or None for a character or class."""
        text, c = self.text, self.text[self.pos]
        if c == "(":
            self.pos += 1
            if text.startswith("?", self.pos):  # (?:...), (?=...), (?<name>...)
                self.pos += 1
                while self.pos < len(text) and text[self.pos] not in ":=!>)":
                    self.pos += 1
                if self.pos < len(text) and text[self.pos] != ")":
                    self.pos += 1
            self.max_nesting = max(self.max_nesting, depth + 1)
            seqs = self.alternation(depth + 1)
            if self.pos < len(text):  # the ')'
                self.pos += 1
            return seqs
        if c == "[":
            self.pos += 1
            if text.startswith("^", self.pos):
                self.pos += 1
            if text.startswith("]", self.pos):  # a leading ']' is a member
                self.pos += 1
            while self.pos < len(text) and text[self.pos] != "]":
                self.pos += 2 if text[self.pos] == "\\" else 1
            self.pos += 1
            return None
        self.pos += 2 if c == "\\" else 1
        return None

    def quantifier(self) -> int | None:
        """Consume a quantifier (and a lazy/possessive suffix); its minimum count, or None
        when there is none."""
        text = self.text
        if self.pos >= len(text):
            return None
        c = text[self.pos]
        if c in "?*+":
            self.pos += 1
            low: int | None = 1 if c == "+" else 0
        elif c == "{":
            end = text.find("}", self.pos)
            body = text[self.pos + 1 : end] if end > 0 else ""
            low_text = body.split(",")[0].strip()
            if not low_text.isdigit() or not all(p.strip().isdigit() or not p.strip()
                                                  for p in body.split(",")[1:2]):  # fmt: skip
                return None  # a literal '{'
            self.pos = end + 1
            low = int(low_text)
        else:
            return None
        if self.pos < len(text) and text[self.pos] in "?+":
            self.pos += 1
        return low
