"""LoRA adapters against HF PEFT on the tiny model: greedy tokens equal, log-probs within
1e-3, a mixed batch of adapters and the base equal to each run alone, no cache reuse across
adapters, and the refusals at load (each names its field)."""

from __future__ import annotations

import shutil

import pytest
import torch
from lora_adapters import ADAPTERS, edit_config, make_adapters
from peft_helpers import peft_greedy
from safetensors.torch import save_file

from radixrt import SamplingParams
from radixrt.cache.namespace import CacheNamespace
from radixrt.lora import LoraInUse, LoraLoadError, UnknownLora
from radixrt.sampling import DEFAULT_OPTIONS

PROMPTS = ["The quick brown fox", "Once upon a time, in a small village by the sea, there lived"]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    return make_adapters(tiny_model_dir, str(tmp_path_factory.mktemp("adapters")))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    """PEFT's greedy tokens and their log-probs per (adapter, prompt); adapter None: base."""
    import peft
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    out = {}
    for name in [None, *adapters]:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32
        )
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out[name, prompt] = peft_greedy(model, ids, MAX_NEW)
    return out


def _engine(make_engine, adapters, **options):
    options.setdefault("max_loras", 4)
    engine = make_engine(**options)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    return engine


def _check(out, ref):
    tokens, scores = ref
    assert out.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, scores)) < 1e-3


def test_each_adapter_matches_peft(make_engine, adapters, reference):
    engine = _engine(make_engine, adapters, prefix_cache="none")
    for name in [None, *adapters]:
        outs = engine.generate(PROMPTS, GREEDY, lora=name)
        for prompt, out in zip(PROMPTS, outs):
            _check(out, reference[name, prompt])
    # the adapters change the output (the test would pass vacuously otherwise)
    base = {reference[None, p][0][0] for p in PROMPTS}
    assert all(reference[n, PROMPTS[1]][0] != reference[None, PROMPTS[1]][0] for n in adapters)
    assert base


def test_mixed_batch_equals_each_alone(make_engine, adapters, reference):
    """4 adapters and the base in one batch (every step mixes them) through the radix cache."""
    engine = _engine(make_engine, adapters, prefix_cache="radix")
    names = [None, *adapters]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    outs = engine.generate(prompts, GREEDY, lora=loras)
    for prompt, name, out in zip(prompts, loras, outs):
        _check(out, reference[name, prompt])


def test_no_cache_reuse_across_adapters(make_engine, adapters, reference):
    """The same prompt under another adapter matches nothing cached (it would if the cache
    key dropped the adapter); under the same adapter it does, and outputs stay PEFT's."""
    for cache in ("radix", "blockhash"):
        engine = _engine(make_engine, adapters, prefix_cache=cache, block_size=4)
        prompt = PROMPTS[1]
        first = engine.generate([prompt], GREEDY, lora="all8")[0]
        assert first.num_cached_tokens == 0
        for name in [None, "qv4"]:
            out = engine.generate([prompt], GREEDY, lora=name)[0]
            assert out.num_cached_tokens == 0, (cache, name)
            _check(out, reference[name, prompt])
        again = engine.generate([prompt], GREEDY, lora="all8")[0]
        assert again.num_cached_tokens > 0
        _check(again, reference["all8", prompt])


def test_namespace_keys_take_the_adapter():
    base, salted = CacheNamespace(), CacheNamespace("t")
    a, b = CacheNamespace(None, "k1"), CacheNamespace(None, "k2")
    seeds = {ns.chain_seed(b"x") for ns in (base, salted, a, b, CacheNamespace("t", "k1"))}
    assert len(seeds) == 5
    assert base.chain_seed(b"x") == b"x" and salted.event_salt == "t"
    assert len({a.event_salt, b.event_salt, base.event_salt}) == 3


def test_slot_pool_swaps_and_admission(make_engine, adapters, reference):
    """Two device slots, two adapters in host memory, four adapters in one call: requests of
    a third adapter wait for a slot, adapters are swapped in and read again, outputs stay."""
    engine = _engine(make_engine, adapters, max_loras=2, max_cpu_loras=2, prefix_cache="none")
    names = list(adapters) * 2
    outs = engine.generate([PROMPTS[0]] * len(names), GREEDY, lora=names)
    for name, out in zip(names, outs):
        _check(out, reference[name, PROMPTS[0]])
    slots = engine.core.runner.lora
    assert slots.num_swaps_in >= len(adapters)
    assert slots.num_host_reads >= len(adapters)


def test_refusals_name_the_field(make_engine, adapters, tmp_path):
    engine = make_engine(max_loras=1, max_lora_rank=8)

    def refused(path, field):
        with pytest.raises(LoraLoadError) as e:
            engine.load_lora("x", path)
        assert e.value.field == field and field in str(e.value)

    refused(adapters["rs16"], "r")  # rank 16 > 8
    for fields, field in [
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ]:
        path = tmp_path / field
        shutil.copytree(adapters["qv4"], path)
        edit_config(str(path), **fields)
        refused(str(path), field)
    # an adapter of a model with another hidden size
    path = tmp_path / "other_base"
    shutil.copytree(adapters["qv4"], path)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(4, 256),
            f"{prefix}.lora_B.weight": torch.zeros(256, 4),
        },
        str(path / "adapter_model.safetensors"),
    )
    refused(str(path), "base_model_name_or_path")
    with pytest.raises(UnknownLora, match="nope"):
        engine.generate(["x"], GREEDY, lora="nope")
    engine.load_lora("qv4", adapters["qv4"])
    with pytest.raises(LoraLoadError, match="lora_name"):
        engine.load_lora("qv4", adapters["all8"])  # a taken name
    rid = engine.add_request([5, 6, 7], GREEDY, options=engine.with_lora(DEFAULT_OPTIONS, "qv4"))
    with pytest.raises(LoraInUse, match=rid):
        engine.unload_lora("qv4")
    engine.abort(rid)
    engine.unload_lora("qv4")
    assert "qv4" not in engine.loras


def test_lora_off_refuses_adapters(make_engine, adapters):
    engine = make_engine()
    with pytest.raises(ValueError, match="max_loras"):
        engine.load_lora("a", adapters["qv4"])
    assert set(ADAPTERS) == set(adapters)


def test_per_adapter_counters(make_engine, adapters):
    """Each adapter's finished requests, prompt and generated tokens (an n > 1 request's
    choices count each; base requests under no adapter)."""
    engine = _engine(make_engine, adapters, prefix_cache="radix")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    engine.generate(prompt_token_ids=prompts, sampling_params=params, lora="qv4")
    engine.generate(prompt_token_ids=[[5, 6]], sampling_params=params, lora="all8")
    engine.generate(prompt_token_ids=prompts, sampling_params=params)  # the base's
    two = SamplingParams(max_tokens=3, n=2, temperature=1.0, ignore_eos=True, seed=1)
    engine.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=two, lora="all8")
    stats = engine.core.stats_struct()
    assert stats.lora_requests == {"qv4": 2, "all8": 3}
    assert stats.lora_prompt_tokens == {"qv4": 7, "all8": 2 + 2 * 3}
    assert stats.lora_generated_tokens == {"qv4": 10, "all8": 5 + 2 * 3}
    view = engine.core.stats()
    assert view["lora_requests:qv4"] == 2 and view["lora_generated_tokens:all8"] == 11
