"""The OpenAI-compatible API through the official `openai` client, greedy parity with the
in-process Engine, 64 concurrent requests, /metrics, and the API key."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, http_call, serving

from radixrt import SamplingParams

API_KEY = "sk-test-key"
PROMPTS = ["Tell me a story about a dragon who", "The list of ingredients: flour, sugar,", "x"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=30, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir


def test_auth_and_models(server, model):
    assert http_call(server.url + "/health", None, method="GET")[0] == 200  # no key needed
    status, body = http_call(server.url + "/v1/models", None, method="GET")
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    wrong = {"Authorization": "Bearer nope"}
    assert http_call(server.url + "/v1/models", None, wrong, method="GET")[0] == 401
    status, body = server.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == model
    assert body["data"][0]["max_model_len"] == 2048


def test_completion(client, model):
    out = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    again = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache served it


def test_chat(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        out.usage.completion_tokens
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completion_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_greedy_matches_engine(server, client, model, tiny_model_dir):
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = engine.generate(PROMPTS, params)
    engine.shutdown()
    for prompt, exp in zip(PROMPTS, expected):
        status, out = server.post(
            "/generate",
            {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                 "ignore_eos": True}},
        )  # fmt: skip
        assert status == 200, out
        assert out["output_ids"] == exp.token_ids and out["text"] == exp.text
        comp = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert comp.choices[0].text == exp.text


def test_n_list_prompts_ids_and_logprobs(client, model, tiny_model_dir):
    out = client.completions.create(
        model=model, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0.8, seed=3, logprobs=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    ids = client.completions.create(model=model, prompt=[5, 17, 99], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    batch = client.completions.create(
        model=model, prompt=[[5, 17, 99], [7, 8]], max_tokens=3, temperature=0
    )
    assert batch.choices[0].text == ids.choices[0].text and len(batch.choices) == 2


def test_stop_string(client, model):
    kw = dict(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_64_concurrent_requests(server, model):
    async def one(http: aiohttp.ClientSession, i: int) -> dict:
        body = {
            "model": model,
            "prompt": f"Request number {i} says",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def main() -> list[dict]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(headers=server.headers(), timeout=timeout) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    outs = asyncio.run(main())
    assert len(outs) == 64
    assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    server.wait_idle()


def test_metrics(server):
    status, text = server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name: families[name].samples[0].value
    assert value("radixrt_prompt_tokens") > 0
    assert value("radixrt_generated_tokens") > 0
    assert value("radixrt_cached_tokens") > 0
    assert 0 < value("radixrt_cache_hit_rate") <= 1
    assert value("radixrt_kv_blocks_total") > 0
    assert value("radixrt_kv_blocks_in_use") == 0
    for name in ("radixrt_num_requests_running", "radixrt_num_requests_waiting"):
        assert value(name) == 0
    assert sum(s.value for s in families["radixrt_requests"].samples if s.name.endswith("total"))
    for hist in ("radixrt_time_to_first_token_seconds", "radixrt_inter_token_latency_seconds"):
        count = [s for s in families[hist].samples if s.name.endswith("_count")][0]
        assert count.value > 0


def test_speculative_counters_in_metrics(tiny_model_dir):
    """A server drafting from the radix tree exports its verify counters in /metrics (the
    second identical request is drafted from the first one's cached continuation) and per
    request in /generate's meta_info, and the greedy output equals the server without
    speculation."""
    body = {"prompt": "one two three one two three one two three one two", "max_tokens": 12}
    body |= {"temperature": 0}
    texts = []
    for args in ((), ("--speculative-method", "radix", "--num-speculative-tokens", "3")):
        srv = ServerProcess(tiny_model_dir, *args)
        try:
            srv.wait_ready()
            for _ in range(2):
                status, out = srv.post("/v1/completions", body)
                assert status == 200, out
                texts.append(out["choices"][0]["text"])
            # per-request counters in /generate's meta_info (a third identical request)
            sp = {"max_new_tokens": 12, "temperature": 0}
            status, gen = srv.post("/generate", {"text": body["prompt"], "sampling_params": sp})
            assert status == 200, gen
            meta = gen["meta_info"]
            assert (meta["spec_draft_tokens"] > 0) == bool(args)
            assert 0 <= meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
            texts.append(gen["text"])
            status, text = srv.get("/metrics")
            families = {f.name: f for f in text_string_to_metric_families(text)}
            drafted = families["radixrt_spec_draft_tokens"].samples[0].value
            accepted = families["radixrt_spec_accepted_tokens"].samples[0].value
            assert (drafted > 0) == bool(args) and 0 <= accepted <= drafted
            srv.wait_idle()
        finally:
            srv.stop()
    assert len(set(texts)) == 1
