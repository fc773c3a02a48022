"""What the trained tiny model learned, and that training is deterministic.

The held-out prose (tests/data/heldout_prose.txt) was written for these tests and is not in
the training text. The model must predict it far better than chance (ln vocab) and better
than an interpolated bigram model of its own training text over the same tokens.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import math
import os
import re

import pytest
import torch

from radixrt import cli
from radixrt.hf_dir import load_tokenizer
from radixrt.model import tiny, tiny_data, tiny_train
from radixrt.model.tiny import make_tiny_model, read_training_file
from radixrt.model.tiny_train import TrainSettings

HELDOUT_PATH = os.path.join(os.path.dirname(__file__), "data", "heldout_prose.txt")
# Reduced settings for the determinism test: same code path, seconds instead of minutes.
QUICK = TrainSettings(steps=3, batch_size=2, seq_len=64, warmup_steps=1)
WORD = re.compile(r"[a-z]+")


def heldout_paragraphs() -> list[str]:
    with open(HELDOUT_PATH, encoding="utf-8") as f:
        return [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def training_ids(tokenizer) -> list[int]:
    """The token stream the model was trained on (the training text, one pass)."""
    return tiny_train.training_stream(tokenizer.encode, tiny.EOS_ID, seed=0).tolist()


def bigram_loss(train: list[int], paragraphs: list[list[int]], vocab: int) -> dict[str, float]:
    """Mean next-token loss (nats) of an add-0.5 unigram and of 0.7 x bigram MLE + 0.3 x that
    unigram (the unigram alone after a token never seen as a context)."""
    unigram = collections.Counter(train)
    bigram = collections.Counter(zip(train, train[1:]))
    contexts = collections.Counter(train[:-1])

    def p_unigram(b: int) -> float:
        return (unigram[b] + 0.5) / (len(train) + 0.5 * vocab)

    def p_bigram(a: int, b: int) -> float:
        if not contexts[a]:
            return p_unigram(b)
        return 0.7 * bigram[a, b] / contexts[a] + 0.3 * p_unigram(b)

    pairs = [(a, b) for ids in paragraphs for a, b in zip(ids, ids[1:])]
    return {
        "unigram": -sum(math.log(p_unigram(b)) for _, b in pairs) / len(pairs),
        "bigram": -sum(math.log(p_bigram(a, b)) for a, b in pairs) / len(pairs),
    }


def model_loss(model_dir: str, paragraphs: list[list[int]]) -> float:
    """Mean next-token loss (nats) of the HF model, each paragraph its own sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in paragraphs:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            count += len(ids) - 1
    return total / count


def test_heldout_prose_is_not_training_text() -> None:
    training = " ".join(words(" ".join(tiny_data.training_documents())))
    heldout = words(" ".join(heldout_paragraphs()))
    for i in range(len(heldout) - 5):
        window = " ".join(heldout[i : i + 6])
        assert f" {window} " not in f" {training} ", window


def test_heldout_loss_beats_bigram(tiny_model_dir, tokenizer, training_ids, capsys) -> None:
    paragraphs = [tokenizer.encode(p) for p in heldout_paragraphs()]
    assert max(map(len, paragraphs)) <= tiny.TRAIN_SETTINGS.seq_len  # in the trained length
    vocab = len(tokenizer)
    baselines = bigram_loss(training_ids, paragraphs, vocab)
    loss = model_loss(tiny_model_dir, paragraphs)
    with capsys.disabled():
        print(
            f"\nheld-out loss (nats/token): model {loss:.3f}, bigram {baselines['bigram']:.3f}, "
            f"unigram {baselines['unigram']:.3f}, random {math.log(vocab):.3f}"
        )
    assert loss < 0.8 * math.log(vocab)
    assert loss < baselines["bigram"] < baselines["unigram"]


def test_training_file_records_the_run(tiny_model_dir) -> None:
    info = read_training_file(tiny_model_dir)
    assert info is not None
    assert info["settings"] == tiny.dataclasses.asdict(tiny.TRAIN_SETTINGS)
    assert info["seed"] == 0 and info["num_train_tokens"] > 50_000
    assert 0 < info["final_train_loss"] < 5.0


def safetensors_sha256(model_dir: str) -> str:
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_training_is_deterministic_and_restores_torch_settings(tmp_path) -> None:
    threads = torch.get_num_threads()
    a = make_tiny_model(str(tmp_path / "a"), train_settings=QUICK, progress=False)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    b = make_tiny_model(str(tmp_path / "b"), train_settings=QUICK, progress=False)
    c = make_tiny_model(str(tmp_path / "c"), train_settings=QUICK, seed=1, progress=False)
    assert safetensors_sha256(a) == safetensors_sha256(b)
    assert safetensors_sha256(a) != safetensors_sha256(c)
    info_a, info_b = read_training_file(a), read_training_file(b)
    assert info_a["final_train_loss"] == info_b["final_train_loss"]
    assert info_a["settings"]["steps"] == QUICK.steps


def test_chat_template_matches_render_chat(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == tiny_data.render_chat(messages)


def demo_answers(model_dir: str, capsys) -> list[str]:
    """Run `radixrt demo --device cpu` on `model_dir` (it exits non-zero when a check fails);
    its chat answers and generated texts."""
    from radixrt import demo

    cli.main(["demo", "--device", "cpu", "--model", model_dir])
    out = capsys.readouterr().out

    def texts(label: str) -> list[str]:  # the demo prints each text as a Python repr
        return [ast.literal_eval(t) for t in re.findall(label + r": (.*)$", out, flags=re.M)]

    chat, branches, samples = texts("assistant"), texts(r"branch \d"), texts(r"sample \d")
    assert len(chat) == len(demo.CHAT_TURNS) and len(branches) == 3 and len(samples) == 4
    assert out.count("same tokens: yes") == len(demo.CHAT_TURNS)
    assert "parses and matches the schema: yes" in out and "FAILED" not in out
    return chat + branches + samples


def test_demo_speaks_english(tiny_model_dir, capsys) -> None:
    """The demo's checks pass, its output is the same every run (greedy or seeded), and its
    greedy chat answers are words of the training text."""
    from radixrt import demo

    answers = demo_answers(tiny_model_dir, capsys)
    assert demo_answers(tiny_model_dir, capsys) == answers
    chat = answers[: len(demo.CHAT_TURNS)]
    vocabulary = set(words(" ".join(tiny_data.training_documents())))
    generated = [w for answer in chat for w in words(answer)]
    assert all(words(a) for a in chat), chat  # every answer has a word
    assert sum(w in vocabulary for w in generated) >= 0.9 * len(generated), generated
