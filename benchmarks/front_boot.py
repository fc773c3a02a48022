"""Start a benchmark process on a given radixrt checkout (A/B runs of two fronts).

Imports nothing from radixrt: `boot` first makes `radixrt` resolve to `code_dir/radixrt`
(when given), then unpickles the target's arguments (their classes import radixrt) and
calls the target. The benchmark's own modules (benchmarks.*) stay this checkout's.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
from typing import Any


def use_radixrt_from(code_dir: str) -> None:
    """Make `import radixrt...` load `code_dir/radixrt` in this process. Raises
    RuntimeError when another radixrt is imported already."""
    package_dir = os.path.join(os.path.abspath(code_dir), "radixrt")
    loaded = sys.modules.get("radixrt")
    if loaded is not None:
        where = os.path.dirname(os.path.abspath(loaded.__file__ or ""))
        if os.path.realpath(where) != os.path.realpath(package_dir):
            raise RuntimeError(f"radixrt is imported from {where} already, not {package_dir}")
        return
    init = os.path.join(package_dir, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"no radixrt package in {code_dir!r} (expected {init})")
    spec = importlib.util.spec_from_file_location(
        "radixrt", init, submodule_search_locations=[package_dir]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["radixrt"] = module
    spec.loader.exec_module(module)


def boot(code_dir: str | None, target: str, payload: bytes, *extra: Any) -> None:
    """Call `target` ("module:function") with the pickled arguments `payload`, then
    `extra` (what cannot be pickled outside of process start-up: pipe ends)."""
    if code_dir is not None:
        use_radixrt_from(code_dir)
    module, name = target.split(":")
    func = getattr(importlib.import_module(module), name)
    func(*pickle.loads(payload), *extra)
