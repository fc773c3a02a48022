"""LoRA adapters through the server: the openai SDK by adapter name, SGLang's lora_path,
/v1/models with `parent`, loading and unloading at run time (404 for an unknown adapter, 409
naming the requests that use one being unloaded)."""

from __future__ import annotations

import openai
import pytest
from lora_adapters import write_random_adapter
from prometheus_client.parser import text_string_to_metric_families
from server_utils import http_call, open_raw_stream, read_until, serving

from radixrt import SamplingParams

PROMPT = "Once upon a time"
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {n: write_random_adapter(tiny_model_dir, str(root / n), seed=i) for i, n in
            enumerate(("a1", "a2"))}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dirs):
    with serving(
        tiny_model_dir, "--max-loras", "2", "--lora-modules", f"a1={adapter_dirs['a1']}"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter_dirs):
    """Greedy texts of the in-process engine, per adapter (None: the base)."""
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", max_loras=2)
    for name, path in adapter_dirs.items():
        engine.load_lora(name, path)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    out = {n: engine.generate([PROMPT], params, lora=n)[0].text for n in [None, *adapter_dirs]}
    engine.shutdown()
    assert len(set(out.values())) == 3  # the adapters change the text
    return out


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=30, max_retries=0)


def _complete(client, model: str) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def test_openai_sdk_by_adapter_name(server, expected):
    client = _client(server)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a1"].parent == next(iter(cards))  # the base model's card comes first
    assert _complete(client, "a1") == expected["a1"]
    assert _complete(client, "default") == expected[None]
    with pytest.raises(openai.NotFoundError, match="nope"):
        _complete(client, "nope")


def test_generate_lora_path(server, expected):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True}}  # fmt: skip
    status, out = http_call(server.url + "/generate", {**body, "lora_path": "a1"})
    assert status == 200 and out["text"] == expected["a1"]
    status, out = http_call(server.url + "/generate", {**body, "lora_path": "nope"})
    assert status == 404 and "nope" in out["error"]["message"]
    assert out["error"]["param"] == "lora_path"


def test_load_use_unload(server, expected, adapter_dirs):
    url = server.url
    status, _ = http_call(url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": "/no"})
    assert status == 400
    body = {"lora_name": "a2", "lora_path": adapter_dirs["a2"]}
    status, text = http_call(url + "/v1/load_lora_adapter", body)
    assert status == 200, text
    client = _client(server)
    assert _complete(client, "a2") == expected["a2"]
    # a long stream under a2: unloading it is refused, naming the request
    sock = open_raw_stream(server.port, "/v1/completions", {"model": "a2", "prompt": PROMPT,
        "max_tokens": 1500, "stream": True, "ignore_eos": True})  # fmt: skip
    try:
        head = read_until(sock, b"data: ")
        assert b"200 OK" in head
        status, out = http_call(url + "/v1/unload_lora_adapter", {"lora_name": "a2"})
        assert status == 409 and "cmpl-" in out["error"]["message"]
    finally:
        sock.close()
    server.wait_idle()
    status, out = http_call(url + "/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200 and out["success"]
    with pytest.raises(openai.NotFoundError, match="a2"):
        _complete(client, "a2")
    status, _ = http_call(url + "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 404


def _lora_metrics(server) -> dict[str, dict[str, float]]:
    server.wait_idle()
    status, text = server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        m: {s.labels["lora"]: s.value for s in families[f"radixrt_lora_{m}"].samples}
        for m in ("requests", "prompt_tokens", "generated_tokens")
    }


def test_metrics_count_each_adapter(server):
    before = _lora_metrics(server)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True}}  # fmt: skip
    prompt_tokens = 0
    for _ in range(3):
        status, out = http_call(server.url + "/generate", {**body, "lora_path": "a1"})
        assert status == 200
        prompt_tokens += out["meta_info"]["prompt_tokens"]
    assert http_call(server.url + "/generate", body)[0] == 200  # the base's: not counted
    after = _lora_metrics(server)
    grew = {m: after[m]["a1"] - before[m].get("a1", 0) for m in after}
    assert grew == {"requests": 3, "prompt_tokens": prompt_tokens, "generated_tokens": 3 * MAX_NEW}
    assert set(after["requests"]) <= {"a1", "a2"}
