"""LoRA on a real model, SmolLM2-135M-Instruct (its pinned GGUF file, CPU float32), against
HF PEFT over transformers' own loading of the same file: two adapters made here with PEFT
(random A, small random B), greedy tokens identical and log-probs within 1e-3 for each
adapter and the base, and a mixed batch of both adapters and the base equal to each alone."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from peft_helpers import peft_greedy
from smollm2_model import smollm2_gguf  # noqa: F401  (fixture)

from radixrt import Engine, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=True)
# name -> (r, lora_alpha, target modules, use_rslora, std of B: outputs move, not to noise)
ADAPTERS = {
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, 0.25),
    "all16": (16, 8, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], True, 0.15),
}


@pytest.fixture(scope="module")
def peft_run(smollm2_gguf, tmp_path_factory):  # noqa: F811
    """The adapters' directories and PEFT's greedy tokens and log-probs per (adapter, prompt)
    (adapter None: the base model), from one PeftModel holding both adapters."""
    import peft
    import transformers

    from radixrt.hf_dir.gguf_file import prepare_gguf_dir

    folder, name = os.path.split(smollm2_gguf)
    # the tokenizer radixrt converted from the file once (transformers' conversion, cached)
    tok = transformers.AutoTokenizer.from_pretrained(prepare_gguf_dir(smollm2_gguf))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    out_dir = str(tmp_path_factory.mktemp("smollm2_adapters"))
    model = None
    for seed, (adapter, (r, alpha, targets, rslora, std)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
        )
        if model is None:
            model = peft.get_peft_model(base, config, adapter_name=adapter)
        else:
            model.add_adapter(adapter, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # PEFT's B starts at zero: small random values move the outputs
            for n, p in model.named_parameters():
                if f"lora_B.{adapter}." in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    paths = {
        os.path.basename(os.path.dirname(f)) if os.path.dirname(f) != out_dir else "": f
        for f in glob.glob(f"{out_dir}/**/adapter_config.json", recursive=True)
    }
    dirs = {a: os.path.dirname(paths[a if a in paths else ""]) for a in ADAPTERS}
    model.eval()
    ref = {}
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    for adapter in [None, *ADAPTERS]:
        for prompt, ids in zip(PROMPTS, prompt_ids):
            if adapter is None:
                with model.disable_adapter():
                    ref[adapter, prompt] = peft_greedy(model, ids, MAX_NEW)
            else:
                model.set_adapter(adapter)
                ref[adapter, prompt] = peft_greedy(model, ids, MAX_NEW)
    return {"dirs": dirs, "ref": ref, "prompt_ids": prompt_ids}


def _check(out, ref, what):
    tokens, scores = ref
    assert out.token_ids == tokens, what
    assert max(abs(a - b) for a, b in zip(out.logprobs, scores)) < 1e-3, what


def test_smollm2_adapters_match_peft_alone_and_mixed(smollm2_gguf, peft_run):  # noqa: F811
    ref, ids = peft_run["ref"], peft_run["prompt_ids"]
    names = [None, *ADAPTERS]
    # the adapters change the output (the test would pass vacuously otherwise)
    for prompt in PROMPTS:
        assert all(ref[a, prompt][0] != ref[None, prompt][0] for a in ADAPTERS), prompt
    engine = Engine(
        smollm2_gguf,
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        max_loras=2,
        max_lora_rank=16,
    )
    try:
        for adapter, path in peft_run["dirs"].items():
            engine.load_lora(adapter, path)
        for adapter in names:
            outs = engine.generate(prompt_token_ids=ids, sampling_params=GREEDY, lora=adapter)
            for prompt, out in zip(PROMPTS, outs):
                _check(out, ref[adapter, prompt], (adapter, prompt))
        mixed_ids = [i for i in ids for _ in names]
        loras = [a for _ in ids for a in names]
        outs = engine.generate(prompt_token_ids=mixed_ids, sampling_params=GREEDY, lora=loras)
        for prompt, adapter, out in zip([p for p in PROMPTS for _ in names], loras, outs):
            _check(out, ref[adapter, prompt], ("mixed", adapter, prompt))
        engine.check_integrity()
    finally:
        engine.shutdown()
