"""`radixrt serve` with no --model serves the embedded tiny model; its chat template takes
OpenAI's `developer` role as the system role."""

from __future__ import annotations

from server_utils import serving


def test_serve_without_model_serves_tiny_model(tiny_model_dir):
    # tiny_model_dir: built already, so the server finds it (no training in this test)
    with serving(None) as srv:
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
