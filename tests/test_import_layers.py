"""The packages import one way: every import (lazy ones inside functions included) points down
the layer list below, so there is no import loop between packages and `radixrt.kernels`
imports nothing else from radixrt. A module at the top level of `radixrt` (config.py, plan.py,
...) counts as a package of its own."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"radixrt": "radixrt", "kernels": "radixrt.kernels", "frontend": "radixrt.frontend"}

# Lowest first; a unit imports only units of earlier lines (members of one line import neither
# each other).
LAYERS = [
    {"radixrt._top_level"},
    {"radixrt.kernels"},
    {"radixrt.errors"},
    {
        "radixrt.limits",
        "radixrt.token_bytes",
        "radixrt.json_depth",
        "radixrt.stats",
        "radixrt.deltas",
    },
    {"radixrt.tenant"},
    {"radixrt.sampling", "radixrt.quantization"},
    {"radixrt.options"},
    {"radixrt.config"},
    {"radixrt.hf_dir", "radixrt.tp_shard"},
    {"radixrt.lora"},
    {"radixrt.plan", "radixrt.detokenizer"},
    {"radixrt.kv"},
    {"radixrt.testing"},
    {"radixrt.cache", "radixrt.attention"},
    {"radixrt.model"},
    {"radixrt.grammar"},
    {"radixrt.speculative"},
    {"radixrt.scheduler"},
    {"radixrt.executor"},
    {"radixrt.engine"},
    {"radixrt.server"},
    {"radixrt"},
    {"radixrt.frontend"},
    {"radixrt.demo"},
    {"radixrt.cli"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    rest = parts[1:-1] if parts[-1] == "__init__" else parts[1:]
    return ".".join([SOURCES[parts[0]], *rest])


def unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: radixrt.<first part>."""
    return ".".join(module.split(".")[:2])


def imported_modules(path: Path) -> set[str]:
    """Every radixrt module `path` imports, at module level or inside functions."""
    here = module_name(path)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "radixrt" or m.startswith("radixrt.")}


def source_files() -> list[Path]:
    return [path for folder in SOURCES for path in (ROOT / folder).rglob("*.py")]


def unit_imports() -> dict[str, dict[str, set[str]]]:
    """{importing unit: {imported unit: files}} over every source file. An imported name
    counts as the longest module it names (`from radixrt import Engine` is `radixrt`, the
    package's __init__; `from radixrt import config` is `radixrt.config`)."""
    modules = {module_name(path) for path in source_files()}
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in source_files():
        src = unit(module_name(path))
        for name in imported_modules(path):
            while name not in modules:
                name = name.rpartition(".")[0]
            dst = unit(name)
            if dst != src:
                edges[src][dst].add(str(path.relative_to(ROOT)))
    return edges


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"{name} is in no layer of LAYERS: add it where it belongs")


def test_every_import_points_down_the_layers():
    upward = []
    for src, targets in unit_imports().items():
        for dst, files in targets.items():
            if layer_of(dst) >= layer_of(src):
                upward.append(f"{src} -> {dst} ({', '.join(sorted(files))})")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_kernels_import_nothing_else_from_radixrt():
    # _top_level runs only when the folder is found by its bare name (its module docstring)
    assert set(unit_imports().get("radixrt.kernels", {})) <= {"radixrt._top_level"}


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    """The walker is not vacuous: it reads imports inside functions and relative ones."""
    edges = unit_imports()
    assert "radixrt.kernels" in edges["radixrt.attention"]
    assert "radixrt.speculative" in edges["radixrt.engine"]  # create_proposer, lazily or not
    path = ROOT / "radixrt" / "scheduler" / "scheduler.py"
    assert {"radixrt.config", "radixrt.plan"} <= {unit(m) for m in imported_modules(path)}


def module_imports() -> dict[str, set[str]]:
    """{module: radixrt modules it imports} over every source file (lazy imports included)."""
    modules = {module_name(path) for path in source_files()}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in source_files():
        src = module_name(path)
        for name in imported_modules(path):
            while name not in modules:
                name = name.rpartition(".")[0]
            if name != src:
                edges[src].add(name)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_between_files():
    assert import_cycles(module_imports()) == []


def test_the_cycle_finder_finds_one():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
