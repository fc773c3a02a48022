"""The DSL's LoRA adapters: `gen(lora=...)`, `select(..., lora=...)` and a program's adapter
(`gen_defaults={"lora": ...}`), in process (EngineBackend) and over HTTP (RuntimeEndpoint to
a server serving the same PEFT adapters): each call's text and scores are the engine's under
that adapter, and a program's sent prefixes are cached under its adapter."""

from __future__ import annotations

import pytest
from lora_adapters import make_adapter
from server_utils import serving

from radixrt import SamplingParams
from radixrt.frontend import BackendError, EngineBackend, RuntimeEndpoint, function, gen, select
from radixrt.lora import UnknownLora

PROMPT = "Once upon a time, in a small village by the sea, there lived"
CHOICES = [" a cat", " an old fisherman", " the king"]
MAX_NEW = 8
DEFAULTS = {"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True}
NAMES = [None, "all8", "qv4"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = str(tmp_path_factory.mktemp("adapters"))
    return {name: make_adapter(tiny_model_dir, out, name, i) for i, name in enumerate(NAMES[1:])}


@function
def one_gen(s, lora=None):
    s += PROMPT
    s += gen("g", lora=lora)


@function
def one_select(s, lora=None):
    s += PROMPT
    s += select("c", CHOICES, lora=lora)


@pytest.fixture(scope="module")
def direct(tiny_model_dir, adapters):
    """The engine's own greedy text and choice log-probs under each adapter (None: base)."""
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", max_loras=2)
    try:
        for name, path in adapters.items():
            engine.load_lora(name, path)
        backend = EngineBackend(engine)  # its encode(): the prompts the programs send
        prefix = backend.encode(PROMPT)
        conts = [backend.encode_continuation(c) for c in CHOICES]
        backend.close()
        greedy = SamplingParams(**DEFAULTS)
        score = SamplingParams(max_tokens=0, prompt_logprobs=True, logprob_start_len=len(prefix))
        out = {}
        for name in NAMES:
            text = engine.generate(prompt_token_ids=[prefix], sampling_params=greedy, lora=name)
            scored = engine.generate(
                prompt_token_ids=[prefix + c for c in conts], sampling_params=score, lora=name
            )
            out[name] = (text[0].text, [o.prompt_logprobs for o in scored])
    finally:
        engine.shutdown()
    assert len({text for text, _ in out.values()}) == 3  # the adapters change the text
    return out


def _assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert [len(x) for x in got] == [len(x) for x in want]
    assert all(abs(a - b) < 1e-5 for g, w in zip(got, want) for a, b in zip(g, w))


def _check_programs(backend, direct) -> None:
    for name in NAMES:
        text, logprobs = direct[name]
        # per call
        assert one_gen.run(lora=name, backend=backend, gen_defaults=DEFAULTS)["g"] == text
        state = one_select.run(lora=name, backend=backend)
        _assert_close(state.meta("c")["token_logprobs"], logprobs)
        # per program; a call's own adapter wins over it
        program = {**DEFAULTS, "lora": name}
        assert one_gen.run(backend=backend, gen_defaults=program)["g"] == text
        state = one_select.run(backend=backend, gen_defaults=program)
        _assert_close(state.meta("c")["token_logprobs"], logprobs)
        other = {**DEFAULTS, "lora": "qv4" if name == "all8" else "all8"}
        if name is not None:
            assert one_gen.run(lora=name, backend=backend, gen_defaults=other)["g"] == text


def test_dsl_adapters_in_process(make_engine, adapters, direct):
    engine = make_engine(max_loras=2)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    backend = EngineBackend(engine)
    try:
        _check_programs(backend, direct)
        with pytest.raises(UnknownLora, match="nope"):
            one_gen.run(lora="nope", backend=backend, gen_defaults=DEFAULTS)
        # a select's prefix is cached under its adapter: the scoring requests hit it
        sent = []
        real = backend.cache_prefix

        def recording(ids, salt=None, ttl=0.0, **adapter):
            sent.append(adapter)
            return real(ids, salt, ttl, **adapter)

        backend.cache_prefix = recording  # type: ignore[method-assign]
        one_select.run(backend=backend, gen_defaults={"lora": "qv4"})
        assert sent == [{"lora": "qv4"}]
    finally:
        backend.close()
    with pytest.raises(ValueError, match="lora"):
        gen("g", lora="")


def test_dsl_adapters_over_http(tiny_model_dir, adapters, direct):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with serving(tiny_model_dir, "--max-loras", "2", "--lora-modules", *modules) as srv:
        backend = RuntimeEndpoint(srv.url, model_path=tiny_model_dir)
        _check_programs(backend, direct)
        with pytest.raises(BackendError, match="nope"):
            one_gen.run(lora="nope", backend=backend, gen_defaults=DEFAULTS)
