"""GGUF models: files written with gguf's writer from random HF checkpoints load into the same
model as the checkpoint (llama's q/k permutation undone, tied embeddings, qwen2 biases, qwen3
norms); every supported tensor type dequantizes as gguf's reference dequantizer does; the
tokenizer comes from the file's metadata or from --tokenizer; the rest is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_files import _finish, llama_permute, write_gguf, write_random_kquant_gguf

from radixrt import Engine, SamplingParams
from radixrt.hf_dir import load_tokenizer, resolve_model
from radixrt.model.loader import iterate_hf_weights
from radixrt.model.tiny import make_hf_checkpoint

IDS = [17, 250, 999, 12, 1500, 77, 31, 640, 8, 1999, 333, 42, 1024, 5, 700, 91, 23]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=True)
LEGACY_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# max |dequantized - original| / max |original| per tensor, loose: this checks the layout
TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q5_0": 0.1, "Q5_1": 0.1}


def _run(model: str, **kw):
    engine = Engine(model, device="cpu", dtype="float32", block_size=4, **kw)
    try:
        out = engine.generate(prompt_token_ids=[IDS], sampling_params=GREEDY)[0]
        engine.check_integrity()
        return out, engine.tokenizer
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "arch, extra",
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama", "llama-tied", "qwen2-bias", "qwen3-norms"],
)
def test_gguf_loads_the_checkpoint_it_was_written_from(tmp_path, arch, extra):
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), arch, **extra)
    path = str(tmp_path / "model.gguf")
    write_gguf(hf_dir, path, arch)
    ref, _ = _run(hf_dir)
    out, _ = _run(path, tokenizer=hf_dir)
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs), torch.tensor(ref.prompt_logprobs), atol=1e-5, rtol=0
    )


def _loaded(path: str, tokenizer: str) -> dict[str, torch.Tensor]:
    return dict(iterate_hf_weights(resolve_model(path, tokenizer=tokenizer)))


def _as_written(name: str, t: torch.Tensor, heads: int, kv_heads: int) -> np.ndarray:
    """A loaded llama tensor back in the file's layout (rows permuted as the converter does)."""
    w = t.numpy()
    if name.endswith("q_proj.weight"):
        return llama_permute(w, heads)
    if name.endswith("k_proj.weight"):
        return llama_permute(w, kv_heads)
    return w


@pytest.mark.parametrize("qtype", LEGACY_TYPES)
def test_quantized_types_dequantize_as_gguf_does(tmp_path, qtype):
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / f"model-{qtype}.gguf")
    written = write_gguf(hf_dir, path, "llama", qtype)
    loaded = _loaded(path, hf_dir)
    assert len(loaded) == len(written)
    for (data, kind), (hf_name, t) in zip(written.values(), loaded.items()):  # the file's order
        assert t.dtype == torch.float32
        want = dequantize(data, kind).reshape(t.shape)
        np.testing.assert_array_equal(_as_written(hf_name, t, 4, 2), want)
    # and close to the checkpoint's weights (the layout, not only the bytes, is right)
    ref = dict(iterate_hf_weights(hf_dir))
    for name, t in loaded.items():
        err = ((t - ref[name]).abs().max() / ref[name].abs().max()).item()
        assert err < TOLERANCE.get(qtype, 0.2), (name, err)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_dequantize_as_gguf_does(tmp_path, tiny_model_dir, qtype):
    path = str(tmp_path / f"random-{qtype}.gguf")
    written = write_random_kquant_gguf(path, qtype)
    kind = gguf.GGMLQuantizationType[qtype]
    loaded = _loaded(path, tiny_model_dir)
    names = [n for n in dict.fromkeys(loaded) if loaded[n].ndim == 2]
    assert len(names) == len(written)
    for gguf_name, hf_name in zip(written, names):
        want = dequantize(written[gguf_name], kind)
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(_as_written(hf_name, loaded[hf_name], 4, 2), want)


def test_a_k_quant_model_generates(tmp_path, tiny_model_dir):
    path = str(tmp_path / "random-Q4_K.gguf")
    write_random_kquant_gguf(path, "Q4_K")
    engine = Engine(path, tokenizer=tiny_model_dir, device="cpu", dtype="float32")
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=True)
        out = engine.generate(prompt_token_ids=[[5, 17, 200, 31]], sampling_params=params)[0]
        assert len(out.token_ids) == 6 and np.isfinite(out.prompt_logprobs[1:]).all()
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), "llama")
    folder = tmp_path / "gguf-only"
    folder.mkdir()
    write_gguf(hf_dir, str(folder / "m.gguf"), "llama", "Q8_0", tokenizer_metadata=True)
    model_dir = resolve_model(str(folder))  # a dir holding one .gguf
    ours, ref = load_tokenizer(model_dir), load_tokenizer(hf_dir)
    for text in ["Hello world!", "héllo  wörld 🙂", "a\nb\tc  d", "<|user|> 12345 x=y+1;"]:
        assert ours.encode(text) == ref.encode(text), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ours.eos_token_id == ref.eos_token_id


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "gemma.gguf")
    write_gguf(hf_dir, path, "llama", arch_name="gemma")
    with pytest.raises(ValueError, match="architecture 'gemma'"):
        Engine(path, tokenizer=hf_dir, device="cpu")


def test_unsupported_tensor_type_and_tensor_are_refused_by_name(tmp_path, tiny_model_dir):
    path = str(tmp_path / "q8_1.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(2)
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    row = 2 * gguf.GGML_QUANT_SIZES[q8_1][1]  # two blocks a row
    w.add_tensor("token_embd.weight", np.zeros((16, row), np.uint8), raw_dtype=q8_1)
    _finish(w)
    with pytest.raises(ValueError, match="'token_embd.weight' has type Q8_1"):
        resolve_model(path, tokenizer=tiny_model_dir)
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "rope_freqs.gguf")
    write_gguf(hf_dir, path, "llama", extra_tensors={"rope_freqs.weight": np.ones(16, np.float32)})
    with pytest.raises(ValueError, match="'rope_freqs.weight'"):
        resolve_model(path, tokenizer=hf_dir)


def test_options_that_do_not_apply_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="--tokenizer applies to GGUF models only"):
        resolve_model(tiny_model_dir, tokenizer=tiny_model_dir)
    with pytest.raises(ValueError, match="--revision applies to hub ids"):
        resolve_model(tiny_model_dir, revision="main")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model(str(two))
    assert not os.path.exists(os.path.join(tiny_model_dir, "model.gguf"))


def test_a_process_without_torch_prepares_a_gguf_dir_without_importing_it(tmp_path):
    # the server's front: transformers' GGUF tokenizer reader imports torch, so it runs in a child
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_dir, path, "llama", "Q8_0", tokenizer_metadata=True)
    code = (
        "import sys; from radixrt.hf_dir import load_tokenizer, resolve_model; "
        "d = resolve_model(sys.argv[1]); print(load_tokenizer(d).encode('Hello world!')); "
        "assert 'torch' not in sys.modules"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(load_tokenizer(hf_dir).encode("Hello world!"))
