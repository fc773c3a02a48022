"""pyproject.toml lists every package of the source tree, so a regular (non-editable) install
carries them all: radixrt's subpackages, and kernels/ and frontend/ as radixrt.kernels and
radixrt.frontend."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"radixrt": "radixrt", "kernels": "radixrt.kernels", "frontend": "radixrt.frontend"}


def test_every_package_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *parts]))
    assert found - listed == set(), "add them to [tool.setuptools] packages"
    assert listed - found == set(), "listed but not in the tree"
    assert setuptools["package-dir"] == {
        "radixrt": "radixrt",
        "radixrt.kernels": "kernels",
        "radixrt.frontend": "frontend",
    }
