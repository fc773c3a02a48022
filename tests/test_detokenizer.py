"""IncrementalDetokenizer: streamed text equals the whole text cut at the first stop
string, however the tokens arrive; the text it searches per step is only what it has not
returned yet (shorter than the longest stop string, plus the new text)."""

from __future__ import annotations

import random
import time

import pytest

from radixrt.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token i is byte i: a multi-byte character spans tokens (as with byte-level BPE)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stops: tuple[str, ...], rng: random.Random) -> tuple[str, bool, int]:
    """Feed `text`'s bytes in random chunks; (joined output, stopped, max pending)."""
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer(), stops)
    out, i, longest = [], 0, 0
    while i < len(ids):
        k = rng.randint(1, 5)
        out.append(detok.add(ids[i : i + k], final=i + k >= len(ids)))
        longest = max(longest, len(detok.pending))
        i += k
    return "".join(out), detok.stopped, longest


def expected(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("seed", range(200))
def test_stream_equals_whole_text_cut_at_first_stop(seed):
    rng = random.Random(seed)
    alphabet = "ab é€😀\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = tuple(
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        for _ in range(rng.randint(0, 3))
    )
    got, stopped, longest = stream(text, stops, rng)
    assert (got, stopped) == expected(text, stops)
    if stops:  # held back: at most a proper prefix of a stop string, plus one chunk
        assert longest <= max(map(len, stops)) - 1 + 5


def test_held_back_text_is_released_when_the_stop_does_not_follow():
    detok = IncrementalDetokenizer(ByteTokenizer(), ("STOP",))
    assert detok.add(list(b"abc ST")) == "abc "  # "ST" may start "STOP"
    assert detok.add(list(b"OR")) == "STOR"
    assert detok.add(list(b"xSTO")) == "x"
    assert detok.add(list(b"P and more")) == ""
    assert detok.stopped
    assert detok.add(list(b"later")) == ""


def test_final_flushes_held_back_text():
    detok = IncrementalDetokenizer(ByteTokenizer(), ("STOP",))
    assert detok.add(list(b"the ST")) == "the "
    assert detok.add([], final=True) == "ST"


def test_cost_per_step_does_not_grow_with_the_output():
    """16 stop strings of 256 characters over a 20,000-token output: the pending text
    stays under 256 characters, and late steps cost what early ones do."""
    rng = random.Random(0)
    stops = tuple("".join(rng.choice("xyz") for _ in range(256)) for _ in range(16))
    detok = IncrementalDetokenizer(ByteTokenizer(), stops)
    text = bytes(rng.choice(b"xyz ") for _ in range(20_000))
    times = []
    for i in range(0, len(text), 4):
        t0 = time.perf_counter()
        detok.add(list(text[i : i + 4]))
        times.append(time.perf_counter() - t0)
        assert len(detok.pending) < 256 + 4
    first, last = sorted(times[:500])[250], sorted(times[-500:])[250]  # medians
    assert last < 20 * first + 1e-3, (first, last)  # loose: shared CI machines
    assert len(detok.decoder.ids) <= 8  # only the decode window is kept


def regex_stream(text: str, patterns: tuple[str, ...], include: bool, rng: random.Random):
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer(), stop_regex=patterns, include_stop=include)
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 5)
        out.append(detok.add(ids[i : i + k], final=i + k >= len(ids)))
        i += k
    return "".join(out), detok.stopped


@pytest.mark.parametrize("seed", range(100))
def test_stop_regex_stream_equals_whole_text_cut_at_first_match(seed):
    """Streamed in random chunks, the text is the whole text cut at the first match (or
    after it with include_stop): held-back partial matches are never split."""
    import re

    rng = random.Random(seed)
    text = "".join(rng.choice("ab1 2\n") for _ in range(rng.randint(0, 60)))
    patterns = tuple(rng.sample([r"a\d+b", r"b{2,}", r"\n\n", r"1 2", r"a[ 12]*\n"], 2))
    include = rng.random() < 0.5
    matches = [m for p in patterns if (m := re.search(p, text))]
    if matches:
        first = min(matches, key=lambda m: m.span())
        want = (text[: first.end() if include else first.start()], True)
    else:
        want = (text, False)
    assert regex_stream(text, patterns, include, rng) == want


def test_stop_strings_kept_with_include_stop_and_ignored_before_min_tokens():
    detok = IncrementalDetokenizer(ByteTokenizer(), ("END",), include_stop=True)
    assert detok.add(list(b"abc EN")) + detok.add(list(b"D more")) == "abc END"
    detok = IncrementalDetokenizer(ByteTokenizer(), ("X",), min_tokens=4)
    assert detok.add(list(b"aX")) == "aX"  # 2 tokens: too early to stop
    assert detok.add(list(b"bX")) == "b" and detok.stopped  # 4 tokens now
