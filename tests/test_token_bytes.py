"""TokenBytes / ByteDecoder: streamed text is the tokenizer's own decode of the stream,
for byte-level BPE (the tiny model) and SentencePiece-style byte-fallback BPE; tokenizers
it cannot read exactly get None (and the window decoder)."""

from __future__ import annotations

import codecs
import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.hf_dir import load_tokenizer
from radixrt.model.tiny import ensure_tiny_model
from radixrt.token_bytes import METASPACE, TokenBytes


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(ensure_tiny_model())


def _byte_fallback_tokenizer(strip: bool = True) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: byte tokens <0x00>..<0xFF>, pieces with U+2581, and the
    Replace / ByteFallback / Fuse / Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["a", "b", "é", f"{METASPACE}the", f"{METASPACE}a", METASPACE, "€", "cat"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return fast


def _stream(tokenizer, token_bytes, ctx, ids, skip, rng) -> str:
    detok = IncrementalDetokenizer(tokenizer, (), skip, ctx, token_bytes)
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(detok.add(ids[i : i + k], final=i + k >= len(ids)))
        i += k
    return "".join(out)


def _any_ids(rng: random.Random, n: int, k: int) -> list[int]:
    """Any ids: partial UTF-8 bytes, specials, and ids past the tokenizer's vocabulary."""
    return [rng.randrange(n + 3) for _ in range(k)]


def _text_ids(rng: random.Random, n: int, k: int) -> list[int]:
    """Pieces, specials, ids past the vocabulary and whole characters as byte tokens (the
    byte-fallback decoder replaces invalid runs of byte tokens its own way)."""
    out: list[int] = []
    while len(out) < k:
        if rng.random() < 0.3:
            out += [3 + b for b in rng.choice("aé€😀\n").encode()]
        else:
            out.append(rng.choice([*range(3), *range(259, n + 2)]))
    return out


def _check_streams(tokenizer, seeds: int, ids_of=_any_ids) -> None:
    """head + prefix (the primed context's complete characters) + stream ==
    decode(head + ctx + ids); the head token keeps a decoder's strip of the first space off
    the context."""
    tb = TokenBytes.build(tokenizer)
    assert tb is not None
    n = len(tb.table)
    head = tokenizer.encode("a", add_special_tokens=False)
    assert len(head) == 1
    for seed in range(seeds):
        rng = random.Random(seed)
        ctx = ids_of(rng, n, rng.randint(1, 4))
        while len(ctx) > 4:  # the detokenizer is primed with the last 4: keep characters whole
            ctx = ids_of(rng, n, rng.randint(1, 4))
        ids = ids_of(rng, n, rng.randint(0, 40))
        for skip in (True, False):
            got = _stream(tokenizer, tb, ctx, ids, skip, rng)
            prefix = codecs.getincrementaldecoder("utf-8")("replace").decode(tb.join(ctx, skip))
            want = tokenizer.decode(head + ctx + ids, skip_special_tokens=skip)
            assert "a" + prefix + got == want, seed


def test_byte_level_stream_is_the_tokenizers_decode(tiny_tokenizer):
    _check_streams(tiny_tokenizer, 300)


@pytest.mark.parametrize("strip", [True, False])
def test_byte_fallback_stream_is_the_tokenizers_decode(strip):
    _check_streams(_byte_fallback_tokenizer(strip), 300, _text_ids)


def test_byte_decoder_equals_window_decoder_on_text(tiny_tokenizer):
    """On real text (whole characters) both decoders stream the same text, stop strings
    included."""
    tb = TokenBytes.build(tiny_tokenizer)
    text = "The cat sat on the mat. Ünïcödé ok: 😀 € and\n\nUser: more text after the stop."
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    ctx = tiny_tokenizer.encode("A prompt:", add_special_tokens=False)
    for stops in [(), ("User:",), ("mat", "zzz")]:
        fast = IncrementalDetokenizer(tiny_tokenizer, stops, True, ctx, tb)
        slow = IncrementalDetokenizer(tiny_tokenizer, stops, True, ctx)
        a = [fast.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
        b = [slow.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
        assert "".join(a) == "".join(b)
        assert fast.stopped == slow.stopped == bool(stops)


def test_a_character_split_across_prompt_and_output_comes_out_whole():
    """The prompt's last token starts a character the output's first token completes."""
    tokenizer = _byte_fallback_tokenizer()
    tb = TokenBytes.build(tokenizer)
    euro = "€".encode()  # 3 bytes
    first, rest = [3 + euro[0]], [3 + euro[1], 3 + euro[2]]
    detok = IncrementalDetokenizer(tokenizer, (), True, first, tb)
    assert detok.add(rest[:1]) == ""
    assert detok.add(rest[1:]) == "€"


def test_unreadable_tokenizers_get_none(tiny_tokenizer, monkeypatch):
    class NoBackend:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    assert TokenBytes.build(NoBackend()) is None
    cleaned = _byte_fallback_tokenizer()
    cleaned.clean_up_tokenization_spaces = True  # text is rewritten after decoding
    assert TokenBytes.build(cleaned) is None
    wordpiece = _byte_fallback_tokenizer()
    wordpiece.backend_tokenizer.decoder = decoders.WordPiece()
    assert TokenBytes.build(wordpiece) is None
    # a table that disagrees with the tokenizer on one id is refused as a whole
    backend = tiny_tokenizer.backend_tokenizer
    real = backend.decode_batch
    monkeypatch.setattr(
        type(backend),
        "decode_batch",
        lambda self, seqs, skip_special_tokens: [t + "x" for t in real(seqs, skip_special_tokens)],
        raising=False,
    )
    assert TokenBytes.build(tiny_tokenizer) is None
