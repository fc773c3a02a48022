"""Each top-level class name is defined once across the packages: two classes of one name (say
the engine's `StreamDelta` and a tool parser's) make imports, tracebacks and grep ambiguous."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixrt", "kernels", "frontend")

# Names allowed twice, each with the reason; empty while every twin has been renamed.
ALLOWED_TWICE: dict[str, str] = {}


def top_level_classes(source: str) -> list[tuple[str, int]]:
    return [(n.name, n.lineno) for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]


def duplicate_class_names(root: Path) -> dict[str, list[str]]:
    """Top-level class names defined in more than one place, with their `path:line`s."""
    places: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name, line in top_level_classes(path.read_text()):
                places[name].append(f"{path.relative_to(root)}:{line}")
    return {name: where for name, where in places.items() if len(where) > 1}


def test_top_level_class_names_are_unique():
    duplicates = {n: w for n, w in duplicate_class_names(ROOT).items() if n not in ALLOWED_TWICE}
    assert not duplicates, f"class names defined more than once: {duplicates}"


def test_the_check_sees_a_duplicate(tmp_path):
    (tmp_path / "radixrt" / "a").mkdir(parents=True)
    (tmp_path / "frontend").mkdir()
    (tmp_path / "radixrt" / "a" / "x.py").write_text("class Ready:\n    pass\n")
    (tmp_path / "frontend" / "y.py").write_text("import os\n\n\nclass Ready: ...\n")
    assert duplicate_class_names(tmp_path) == {"Ready": ["radixrt/a/x.py:1", "frontend/y.py:4"]}


def test_allowlist_names_only_real_twins():
    stale = set(ALLOWED_TWICE) - set(duplicate_class_names(ROOT))
    assert not stale, f"allowed twice but defined once: {stale}"
