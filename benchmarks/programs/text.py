"""Seeded program inputs of exact token lengths, and the scripted outputs.

Text is made of words that are one token each (" the", " river", ...): n words are n
tokens, in any context, so every length in a program is known before it runs. Outputs are
scripted too: a gen forces one word with a logit bias (`forced`), so it emits exactly that
token max_tokens times (ignore_eos) on any weights, random ones included, and re-encoding
the text gives the same tokens back. Every configuration then sends the same calls.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from radixrt.frontend import gen

BIAS = 100.0  # the largest logit bias the engine accepts: it outweighs any logit
_WORD = re.compile(r"^ [a-z]{2,}$")


class Words:
    """One-token words of a tokenizer, and seeded text made of them."""

    def __init__(self, tokenizer: Any) -> None:
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append((token_id, text))
        if len(words) < 64:
            raise ValueError(f"the tokenizer has {len(words)} one-token words; need >= 64")
        self.ids = [i for i, _ in words]
        self.texts = [t for _, t in words]

    def text(self, rng: np.random.Generator, num_tokens: int) -> str:
        """`num_tokens` random words (exactly that many tokens), starting with a space."""
        return "".join(self.texts[i] for i in rng.integers(0, len(self.texts), num_tokens))

    def token(self, rng: np.random.Generator) -> int:
        """A word's token id, for a scripted output."""
        return self.ids[int(rng.integers(0, len(self.ids)))]


def forced(name: str | None, max_tokens: int, token: int):
    """A gen that emits `token` exactly `max_tokens` times (greedy, biased, no EOS)."""
    return gen(
        name,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        logit_bias={token: BIAS},
    )


def seeded(seed: int, *keys: object) -> np.random.Generator:
    """An RNG for one part of the inputs: the same (seed, keys) gives the same stream."""
    import zlib

    return np.random.default_rng([seed, zlib.crc32(repr(keys).encode())])
