"""The repository's top-level `kernels/` and `frontend/` folders are the packages
`radixrt.kernels` and `radixrt.frontend`. Where the repository root is on `sys.path` (`python -m`
or `python -c` from the root), Python also finds them under their bare names, which belong to
other distributions: transformers imports Hugging Face's `kernels`. Each folder's `__init__`
hands a bare-name import over to `defer_to_installed`."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def defer_to_installed(name: str, init_file: str) -> None:
    """Load the module `name` from `sys.path` without the repository root into
    `sys.modules[name]`, replacing the folder found by its bare name (the import statement then
    returns it). ModuleNotFoundError when nothing else has that name."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
