"""Hub ids as --model: resolved through huggingface_hub's cache (HF_HOME, HF_HUB_OFFLINE and
revisions honoured), here a cache filled by hand in offline mode (no hub is reachable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

COMMITS = {"main": "a" * 40, "v1": "b" * 40}
RESOLVE = (
    "import sys; from radixrt.hf_dir import resolve_model; "
    "print(resolve_model(sys.argv[1], revision=(sys.argv[2:] or [None])[0]))"
)


@pytest.fixture
def hub_home(tmp_path, tiny_model_dir) -> str:
    """An HF_HOME whose hub cache holds org/tiny (the tiny model) at main and at tag v1."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    for ref, commit in COMMITS.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name in os.listdir(tiny_model_dir):
            shutil.copy(os.path.join(tiny_model_dir, name), snapshot)
    return str(tmp_path / "hf")


def _run(hub_home: str, *args: str, code: str = RESOLVE) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": hub_home, "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_hub_id_resolves_to_its_cached_snapshot(hub_home):
    done = _run(hub_home, "org/tiny")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.path.join(
        hub_home, "hub", "models--org--tiny", "snapshots", COMMITS["main"]
    )
    done = _run(hub_home, "org/tiny", "v1")
    assert done.stdout.strip().endswith(COMMITS["v1"]), done.stderr


def test_uncached_hub_id_error_names_the_id_and_the_cache(hub_home):
    done = _run(hub_home, "org/missing")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "FileNotFoundError" in last and "'org/missing'" in last, last
    assert os.path.join(hub_home, "hub") in last and "HF_HUB_OFFLINE" in last, last


def test_generate_from_a_hub_id(hub_home):
    code = "from radixrt.cli import main; main()"
    args = ["generate", "--model", "org/tiny", "--prompt", "Hello", "--max-tokens", "4"]
    done = _run(hub_home, *args, "--device", "cpu", code=code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
