"""The locally generated tiny Llama: files, config, tokenizer, chat template, HF loading,
the random variant and the shared cache. Training and what it learned: test_tiny_trained.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from radixrt.config import ModelConfig
from radixrt.hf_dir import load_tokenizer
from radixrt.model import tiny
from radixrt.model.loader import iterate_hf_weights
from radixrt.model.tiny import (
    default_tiny_model_dir,
    ensure_tiny_model,
    make_tiny_model,
)

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SMALL = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "héllo 世界 🙂"},
]
RENDERED = (
    "<|system|>\nBe brief.<|end|>\n"
    "<|user|>\nHi there<|end|>\n"
    "<|assistant|>\nHello!<|end|>\n"
    "<|user|>\nhéllo 世界 🙂<|end|>\n"
)


# `tiny_model_dir` (session-scoped, built by ensure_tiny_model) comes from conftest.py.


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: str):
    return load_tokenizer(tiny_model_dir)


def test_files_present(tiny_model_dir: str) -> None:
    for name in FILES:
        assert os.path.isfile(os.path.join(tiny_model_dir, name)), name


def test_config_parses(tiny_model_dir: str, tokenizer) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    shape = tiny.TINY_SHAPE
    assert cfg.vocab_size == len(tokenizer) == tiny.TINY_VOCAB_SIZE == 2048
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        shape["num_layers"],
        shape["hidden_size"],
        shape["intermediate_size"],
    )
    assert (cfg.num_heads, cfg.num_kv_heads) == (shape["num_heads"], shape["num_kv_heads"])
    assert cfg.head_dim == 32  # the GPU tests' FlashInfer path pads 32 to 64
    assert cfg.max_position_embeddings == 2048
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-5
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == tokenizer.bos_token_id == 1
    assert cfg.eos_token_ids == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>"))
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "llama" and raw["torch_dtype"] == "float32"
    assert raw["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize(
    "text",
    [
        "héllo 世界 🙂",
        "Plain ASCII, with punctuation: a-b, c.d; e!",
        "  leading and trailing spaces  \n\n\ttabs\tand\r\nCRLF ",
        "def f(x):\n    return {'k': [1, 2.5, -3]}  # comment\n",
        "Ångström −5 °C € ½ → 🎉🌍 こんにちは 안녕 مرحبا नमस्ते",
        "\x00 control \x1b[0m chars",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.bos_token_id not in ids  # encode adds no special tokens


def test_special_tokens(tokenizer) -> None:
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (
        "<pad>",
        "<s>",
        "</s>",
    )
    assert [tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS] == list(range(7))
    for token in tiny.SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.decode(tokenizer.encode("<|user|>\nhi<|end|>"), skip_special_tokens=True) == (
        "\nhi"
    )


def test_chat_template_renders_roles(tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == RENDERED
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == RENDERED + "<|assistant|>\n"
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tokenizer.encode(prompt)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|system|>")
    assert tokenizer.decode(ids) == prompt


def test_chat_template_rejects_unknown_role(tokenizer) -> None:
    with pytest.raises(Exception, match="unsupported role function"):
        tokenizer.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_chat_template_renders_tools_calls_and_results(tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c", "content": "r"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    one = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert text.startswith(
        '<|system|>\n# Tools\nYou may call these functions:\n<tools>\n{"name": "f"'
    )
    assert f"<|assistant|>\n{one}\n{one}<|end|>\n" in text
    assert text.endswith("<|user|>\n<tool_response>\nr\n</tool_response><|end|>\n")
    assert tokenizer.apply_chat_template(MESSAGES, tools=None, tokenize=False) == RENDERED


@pytest.mark.parametrize("variant", ["trained", "random"])
def test_transformers_loads_checkpoint(request, variant: str, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(
        "tiny_model_dir" if variant == "trained" else "tiny_random_model_dir"
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    state = model.state_dict()
    weights = dict(iterate_hf_weights(model_dir))
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)

    ids = torch.tensor([tokenizer.encode("The weather today is")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert 0.3 < logits[0, -1].std().item() < 3.0  # neither flat nor saturated
    out = model.generate(
        ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
    )  # the trained model may end its answer (<|end|>) early: generate past it
    assert len(set(out[0, ids.shape[1] :].tolist())) > 8  # greedy does not loop on one token


def test_random_deterministic_for_seed(tmp_path) -> None:
    a = make_tiny_model(str(tmp_path / "a"), random=True, seed=3, **SMALL)
    b = make_tiny_model(str(tmp_path / "b"), random=True, seed=3, **SMALL)
    c = make_tiny_model(str(tmp_path / "c"), random=True, seed=4, **SMALL)
    for name in FILES:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    wa, wc = dict(iterate_hf_weights(a)), dict(iterate_hf_weights(c))
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    with (
        open(os.path.join(a, "tokenizer.json")) as fa,
        open(os.path.join(c, "tokenizer.json")) as fc,
    ):
        assert fa.read() == fc.read()


def test_make_tiny_model_rejects_non_empty_dir(tmp_path) -> None:
    (tmp_path / "stale.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        make_tiny_model(str(tmp_path))


def test_default_dir_from_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RADIXRT_TINY_MODEL_DIR", str(tmp_path / "here"))
    assert default_tiny_model_dir() == str(tmp_path / "here")
    assert default_tiny_model_dir(random=True) == str(tmp_path / "here-random")
    monkeypatch.delenv("RADIXRT_TINY_MODEL_DIR")
    trained, random = default_tiny_model_dir(), default_tiny_model_dir(random=True)
    cache = os.path.expanduser("~/.cache/radixrt")
    assert trained.startswith(f"{cache}/tiny-llama-trained-")
    assert random.startswith(f"{cache}/tiny-llama-random-")
    monkeypatch.setattr(tiny, "TINY_MODEL_FORMAT", tiny.TINY_MODEL_FORMAT + 1)
    assert default_tiny_model_dir() != trained  # another generator, another dir


def test_ensure_builds_once(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RADIXRT_TINY_MODEL_DIR", str(tmp_path / "cache" / "tiny"))
    path = ensure_tiny_model(random=True)  # the random variant: no minute of training
    assert path == str(tmp_path / "cache" / "tiny-random")
    for name in FILES:
        assert os.path.isfile(os.path.join(path, name)), name
    ModelConfig.from_pretrained(path)
    assert tiny.read_training_file(path) is None

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt an up-to-date model")

    monkeypatch.setattr(tiny, "make_tiny_model", fail)
    assert ensure_tiny_model(random=True) == path
    assert sorted(os.listdir(tmp_path / "cache")) == ["tiny-random"]  # no temp dirs left
    with pytest.raises(AssertionError, match="rebuilt"):  # the trained one has another key
        ensure_tiny_model(str(path))


def _fake_make(out_dir: str, **kwargs) -> str:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write("{}")
    return out_dir


def test_ensure_rebuilds_stale_and_rejects_foreign(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(tiny, "make_tiny_model", _fake_make)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "old.txt").write_text("x")
    (stale / tiny.MARKER_FILE).write_text(json.dumps({"format": -1}))
    ensure_tiny_model(str(stale))
    assert sorted(os.listdir(stale)) == ["config.json", tiny.MARKER_FILE]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_tiny_model(str(empty)) == str(empty)
    assert os.path.isfile(empty / "config.json")

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a radixrt tiny model"):
        ensure_tiny_model(str(foreign))
    assert os.listdir(foreign) == ["notes.txt"]


def test_ensure_concurrent_callers(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(tiny, "make_tiny_model", _fake_make)
    target = str(tmp_path / "shared" / "tiny")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            assert ensure_tiny_model(target) == target
            assert os.path.isfile(os.path.join(target, "config.json"))
        except BaseException as e:  # reported below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(os.listdir(tmp_path / "shared")) == ["tiny"]


def test_chat_template_takes_developer_as_system(tokenizer) -> None:
    """OpenAI's `developer` role renders exactly as `system`."""
    as_system = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    developer = [{**m, "role": "developer"} if m["role"] == "system" else m for m in MESSAGES]
    assert any(m["role"] == "developer" for m in developer)
    got = tokenizer.apply_chat_template(developer, tokenize=False, add_generation_prompt=True)
    assert got == as_system


def test_stale_chat_template_is_refreshed(tmp_path) -> None:
    """A tiny model dir written with an older template gets the current one (no retraining)."""
    import json

    from radixrt.model.tiny_tokenizer import (
        CHAT_TEMPLATE,
        refresh_chat_template,
        write_tiny_tokenizer,
    )

    write_tiny_tokenizer(str(tmp_path), vocab_size=300)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": "old"}))
    refresh_chat_template(str(tmp_path))
    assert json.loads(path.read_text()) == {**config, "chat_template": CHAT_TEMPLATE}
