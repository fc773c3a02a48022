"""bench_verify's CPU smoke (tiny model): verify-row step times run for host and draft-model
drafts, and the ORACLE's forced acceptance is what it is set to."""

from __future__ import annotations

import numpy as np


def test_bench_verify_smoke(one_thread):
    from benchmarks.bench_verify import Setup, bench_oracle, bench_steps, tables

    s = Setup(tiny=True)
    s.batches, s.ks, s.iters, s.alphas, s.max_tokens = (2,), (2,), 1, (0.0, 0.5, 1.0), 16
    rng = np.random.default_rng(0)
    steps = bench_steps(s, rng, None) + bench_steps(s, rng, s.model_dir)
    assert [(r["kind"], r["k"]) for r in steps] == [
        ("host-drafts", 0),
        ("host-drafts", 2),
        ("draft-model", 0),
        ("draft-model", 2),
    ]
    oracle = bench_oracle(s, rng, (2,))
    by_alpha = {r["alpha"]: r for r in oracle}
    assert by_alpha[0.0]["measured_acceptance"] == 0.0
    assert by_alpha[1.0]["measured_acceptance"] == 1.0
    assert 0.0 < by_alpha[0.5]["measured_acceptance"] < 1.0
    assert by_alpha[1.0]["tokens_per_verify"] > 2.5
    assert "ORACLE" in tables(steps, oracle, "CPU")


def test_text_workloads_are_text(tiny_model_dir):
    """bench_spec's TEXT workloads: chat-template text, each call after its parent."""
    from benchmarks.bench_spec import TEXT_WORKLOADS, text_workload
    from radixrt.hf_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    for name in TEXT_WORKLOADS:
        w = text_workload(name, tok, 0.25)
        assert len(w.programs) == 2 and w.num_calls == 8
        for prog in w.programs:
            assert prog.calls[0].parent is None
            assert all(c.parent == i for i, c in enumerate(prog.calls[1:]))
            first = tok.decode(list(prog.calls[0].input_ids))
            assert "<|user|>" in first and "<|assistant|>" in first
