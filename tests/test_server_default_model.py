"""`radixrt serve --tiny` serves the embedded tiny model; its chat template takes OpenAI's
`developer` role as the system role. Without --model and --tiny, SmolLM2 is served
(tests/test_smollm2_server.py), or the tiny model when SmolLM2 cannot be fetched."""

from __future__ import annotations

import os
import subprocess
import sys

from server_utils import serving


def test_serve_tiny_serves_tiny_model(tiny_model_dir):
    # tiny_model_dir: built already, so the server finds it (no training in this test)
    with serving(None, "--tiny") as srv:
        status, body = srv.get("/v1/models")
        assert status == 200 and body["data"][0]["id"] == tiny_model_dir
        answers = {}
        for role in ("system", "developer"):
            messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
            status, out = srv.post(
                "/v1/chat/completions",
                {"model": tiny_model_dir, "messages": messages, "max_tokens": 6, "temperature": 0},
            )
            assert status == 200, out
            answers[role] = (out["usage"]["prompt_tokens"], out["choices"][0]["message"])
        assert answers["developer"] == answers["system"]  # the same prompt, the same answer
        assert "serving the tiny model" in srv.output()


def test_default_model_falls_back_with_a_reason_when_the_registry_is_unreachable(tmp_path):
    # a fresh HOME (nothing cached) and a pip whose only index refuses connections
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    script = "from radixrt.hf_dir.smollm2 import fetch_default_model; print(fetch_default_model())"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    reason = [ln for ln in done.stderr.splitlines() if "SmolLM2 unavailable" in ln]
    assert len(reason) == 1 and "using the tiny model" in reason[0], done.stderr
