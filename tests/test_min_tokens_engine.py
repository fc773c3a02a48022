"""min_tokens in the engine: EOS and stop_token_ids are masked (never sampled) and do not
end a request before it has min_tokens tokens; stop strings wait too; the pool is intact
after."""

from __future__ import annotations

import pytest

from radixrt import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, device="cpu", dtype="float32")
    yield eng
    eng.shutdown()


def test_min_tokens_masks_stops_until_reached(engine):
    prompt = "The numbers go one two"
    base = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    first, second = base.token_ids[:2]
    stop_first = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first, second))
    out = engine.generate([prompt], stop_first)[0]
    assert out.token_ids == [first] and out.finish_reason.value == "stop"
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first, second), min_tokens=5)
    out = engine.generate([prompt], held)[0]
    assert len(out.token_ids) >= 5
    assert not {first, second} & set(out.token_ids[:5])  # masked, not sampled and ignored
    eos = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, min_tokens=6))
    assert len(eos[0].token_ids) == 6
    word = engine.tokenizer.decode([first]).strip() or base.text[:1]
    assert word and base.text.startswith(engine.tokenizer.decode([first]))
    quick = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop=(word,)))
    assert len(quick[0].token_ids) == 1 and quick[0].finish_reason.value == "stop"
    slow = SamplingParams(max_tokens=8, temperature=0, stop=(word,), min_tokens=4)
    assert len(engine.generate([prompt], slow)[0].token_ids) >= 4
    engine.core.check_integrity()
