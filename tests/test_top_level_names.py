"""The top-level kernels/ and frontend/ folders are radixrt.kernels and radixrt.frontend only:
from the repository root, where Python can find them by their bare names, those names still
resolve to the installed distributions that own them (transformers imports HF's `kernels`)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, pythonpath: Path | None = None, *flags: str):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("name", ["kernels", "frontend"])
def test_an_installed_package_of_the_same_name_wins_from_the_root(tmp_path, name):
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("OWNER = 'installed'\n")
    (site / name / "sub.py").write_text("X = 1\n")
    code = f"import {name}, {name}.sub; print({name}.OWNER, {name}.__file__, {name}.sub.__file__)"
    out = _python(code, cwd=ROOT, pythonpath=site)  # sys.path: the root, then `site`
    assert out.returncode == 0, out.stderr
    owner, init, sub = out.stdout.split()
    assert owner == "installed"
    assert Path(init).parent == site / name and Path(sub).parent == site / name


@pytest.mark.parametrize("name", ["kernels", "frontend"])
def test_a_bare_name_with_no_owner_is_not_found_from_the_root(name):
    # -S: no site-packages, so nothing else provides the name (radixrt comes from the root)
    out = _python(f"import {name}", ROOT, None, "-S")
    assert out.returncode != 0
    assert f"No module named '{name}'" in out.stderr, out.stderr


def test_hugging_face_kernels_resolves_to_its_distribution_from_the_root():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels package is not installed")
    out = _python("import transformers, kernels; print(kernels.__file__)", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == Path(dist.locate_file("kernels/__init__.py")).resolve()


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_radixrt_subpackages_come_from_the_top_level_folders(tmp_path, cwd):
    code = (
        "import radixrt.kernels, radixrt.frontend, radixrt; "
        "print(radixrt.kernels.__file__, radixrt.frontend.__file__, hasattr(radixrt, '__path__') "
        "and len(radixrt.__path__))"
    )
    out = _python(code, cwd=ROOT if cwd == "root" else tmp_path)
    assert out.returncode == 0, out.stderr
    kernels_init, frontend_init, n_paths = out.stdout.split()
    assert Path(kernels_init) == ROOT / "kernels" / "__init__.py"
    assert Path(frontend_init) == ROOT / "frontend" / "__init__.py"
    assert n_paths == "1"  # radixrt/ only: no other top-level folder imports as radixrt.<name>


def test_this_test_process_loaded_no_repository_folder_by_a_bare_name():
    import transformers  # noqa: F401  (imports Hugging Face's kernels where it needs it)

    for name in ("kernels", "frontend"):
        module = sys.modules.get(name)
        if module is not None:
            assert not Path(module.__file__).resolve().is_relative_to(ROOT), module.__file__
