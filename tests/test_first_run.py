"""A new user's first run, from the repository root and from elsewhere: the demo, a server round
trip and a schema-constrained request (its grammar compiles in worker processes, which import
transformers and so Hugging Face's `kernels`). `.ci/run` runs this in a fresh venv with the
newest releases the pins allow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_utils import REPO, serving
from smollm2_model import smollm2_gguf  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(params=["root", "elsewhere"])
def workdir(request, tmp_path):
    return REPO if request.param == "root" else tmp_path


def test_demo_passes_its_checks(tiny_model_dir, workdir):
    cmd = [sys.executable, "-m", "radixrt.cli", "demo", "--model", tiny_model_dir]
    out = subprocess.run(cmd + ["--device", "cpu"], cwd=workdir, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "json_valid ok" in out.stdout, out.stdout[-2000:]


def test_default_demo_runs_smollm2_and_names_paris(smollm2_gguf, tmp_path):  # noqa: F811
    """What the README's first command runs (the model fetched already: the fixture)."""
    cmd = [sys.executable, "-m", "radixrt.cli", "demo", "--device", "cpu"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "SmolLM2-135M-Instruct" in out.stdout.splitlines()[0]
    assert "fact_right ok" in out.stdout and "cache_identical ok" in out.stdout, out.stdout[-2000:]


def test_server_round_trip_with_a_schema(tiny_model_dir, workdir):
    with serving(tiny_model_dir, cwd=workdir) as srv:
        status, out = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] >= 1
        body = {
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "max_tokens": 128,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
        }
        status, out = srv.post("/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        person = json.loads(choice["message"]["content"])
        assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
