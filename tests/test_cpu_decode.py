"""The native CPU decode forward (radixrt.model.cpu_decode): bitwise the layer-by-layer path,
taken only where it applies, rebuilt or dropped when the model changes."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.model.cpu_decode import CpuDecode


def _greedy(engine, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]


def _count_native(monkeypatch) -> list[int]:
    calls = [0]
    orig = CpuDecode.forward

    def counted(self, batch, plan):
        calls[0] += 1
        return orig(self, batch, plan)

    monkeypatch.setattr(CpuDecode, "forward", counted)
    return calls


def _prompts(engine, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    vocab = engine.model_config.vocab_size
    lens = [5 + 7 * i % 40 for i in range(n)]
    return [torch.randint(3, vocab, (k,), generator=gen).tolist() for k in lens]


@pytest.mark.parametrize("model", ["trained", "random", "qwen2"])
def test_native_decode_equals_layer_path(
    native_kernel, make_engine, monkeypatch, tiny_random_model_dir, tmp_path, model
) -> None:
    """Greedy tokens with the native forward on and off are identical (and it ran)."""
    from radixrt.model.tiny import make_hf_checkpoint

    path = {"trained": None, "random": tiny_random_model_dir}.get(model)
    if model == "qwen2":  # q/k/v biases
        path = make_hf_checkpoint(str(tmp_path / "q2"), "qwen2", num_layers=2)
    calls = _count_native(monkeypatch)
    on = make_engine(path, prefix_cache="radix")
    prompts = _prompts(on, 12)
    got = _greedy(on, prompts)
    assert calls[0] > 0, "the native decode forward never ran"
    off = make_engine(path, prefix_cache="radix")
    off.core.runner.model.cpu_decode = False
    before = calls[0]
    assert _greedy(off, prompts) == got
    assert calls[0] == before


def test_hidden_states_bitwise(native_kernel, make_engine) -> None:
    """One decode step's hidden states, native vs layer by layer: equal bits."""
    engine = make_engine(prefix_cache="none")
    runner = engine.core.runner
    batches = []
    orig = runner.build_batch

    def keep(layout):
        fb = orig(layout)
        batches.append(fb)
        return fb

    runner.build_batch = keep
    _greedy(engine, _prompts(engine, 9), n=4)
    runner.build_batch = orig
    fb = batches[-1]
    assert fb.num_decode == fb.num_rows == 9
    model, backend, pool = runner.model, runner.backend, runner.pool
    with torch.inference_mode():
        backend.prepare(fb)
        plan = backend.native_decode_plan()
        assert plan is not None
        fast = model._native_decode(pool)
        assert fast is not None
        native = fast.forward(fb, plan)
        model.cpu_decode = False
        backend.prepare(fb)
        layers = model(fb, backend, pool)
    assert torch.equal(native, layers)


def test_changed_weight_falls_back_then_rebuilds(native_kernel, make_engine, monkeypatch) -> None:
    calls = _count_native(monkeypatch)
    engine = make_engine(prefix_cache="none")
    model = engine.core.runner.model
    prompts = _prompts(engine, 4)
    first = _greedy(engine, prompts, n=6)
    assert calls[0] > 0
    lin = model.layers[0].mlp.down_proj
    with torch.no_grad():
        lin.weight.mul_(1.0)  # same values, a new version: the packed copies are stale
    before = calls[0]
    assert _greedy(engine, prompts, n=6) == first  # the layers, F.linear for that weight
    assert calls[0] == before
    from radixrt.model.linear import prepack_linears

    prepack_linears(model)  # packed again: the native forward is rebuilt
    assert _greedy(engine, prompts, n=6) == first
    assert calls[0] > before


def test_not_taken_where_it_does_not_apply(native_kernel, make_engine, monkeypatch) -> None:
    from radixrt.model.linear import SMALL_MAX_ROWS

    calls = _count_native(monkeypatch)
    engine = make_engine(prefix_cache="none", max_running_requests=SMALL_MAX_ROWS + 8)
    _greedy(engine, _prompts(engine, SMALL_MAX_ROWS + 5), n=3)  # decode steps of 69 rows
    assert calls[0] == 0


def test_replaced_parameter_rebuilds(native_kernel, make_engine) -> None:
    engine = make_engine(prefix_cache="none")
    model, pool = engine.core.runner.model, engine.core.runner.pool
    with torch.inference_mode():
        first = model._native_decode(pool)
        assert first is not None and first.valid(pool)
        model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
        assert not first.valid(pool)
        second = model._native_decode(pool)
    assert second is not None and second is not first and second.valid(pool)
