"""benchmarks/RESULTS.md stays a file of current figures: at most 600 lines, and each section
names its command, a commit or the run it was recorded in, and a date."""

from __future__ import annotations

import os
import re

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "RESULTS.md")
MAX_LINES = 600


def _sections() -> dict[str, str]:
    with open(RESULTS) as f:
        text = f.read()
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def test_at_most_600_lines():
    with open(RESULTS) as f:
        assert len(f.read().splitlines()) <= MAX_LINES


def test_each_section_names_command_commit_and_date():
    sections = _sections()
    assert len(sections) > 10
    for title, body in sections.items():
        if title == "Summary":
            continue
        assert "`" in body, f"{title}: no command"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"{title}: no date"
        assert re.search(r"\b[0-9a-f]{7}\b", body), f"{title}: no commit"
