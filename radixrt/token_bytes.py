"""Each token id's bytes, for detokenization that is O(new tokens).

Byte-level BPE (GPT-2, Llama-3, Qwen, the tiny model) and SentencePiece-style BPE with byte
fallback (Llama-2, Mistral) decode a sequence as the concatenation of its tokens' bytes, read
as UTF-8 with invalid sequences replaced by U+FFFD. With a table id -> bytes, streaming text
is a table lookup per token plus an incremental UTF-8 decoder: no window of tokens decoded
again per token. (Byte-fallback tokenizers differ from it in one case: how many U+FFFD
replace a run of byte tokens that is not valid UTF-8; see `_piece_decoder`.)

`TokenBytes.build` reads the table off the tokenizer's vocabulary and then checks it
against the tokenizer itself: every id decoded after an anchor token must give the anchor's
text plus that id's bytes (specials skipped and kept). Any difference, a decoder of another
kind, or text clean-up after decoding (`clean_up_tokenization_spaces`), and it returns None:
callers then decode windows of tokens with the tokenizer (`detokenizer.WindowDecoder`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"  # SentencePiece's word-boundary mark


def _gpt2_byte_decoder() -> dict[str, int]:
    """The printable character byte-level BPE uses for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True)
class TokenBytes:
    """`table[id]`: the bytes token `id` decodes to (specials: their text); ids past the
    table decode to nothing (as the tokenizer skips them)."""

    table: tuple[bytes, ...]
    special: frozenset[int]  # ids skip_special_tokens drops

    def join(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool) -> bytes:
        table, n = self.table, len(self.table)
        if skip_special_tokens and self.special:
            special = self.special
            return b"".join(table[t] for t in ids if 0 <= t < n and t not in special)
        return b"".join(table[t] for t in ids if 0 <= t < n)

    @classmethod
    def build(cls, tokenizer: Any) -> TokenBytes | None:
        """The table of a fast (HF `tokenizers`) tokenizer, or None when its decoding is
        not a concatenation of per-token bytes (then decode windows instead)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        try:
            decoder = json.loads(backend.to_str()).get("decoder")
        except (ValueError, AttributeError):
            return None
        found = _piece_decoder(decoder)
        if found is None:
            return None
        piece_bytes, whole_runs = found
        n = backend.get_vocab_size(with_added_tokens=True)
        added = {
            i: tok for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if i < n
        }
        table = []
        for i in range(n):
            if i in added:
                table.append(str(added[i]).encode())
                continue
            piece = backend.id_to_token(i)
            b = None if piece is None else piece_bytes(piece)
            if b is None:
                return None
            table.append(b)
        special = frozenset(i for i, tok in added.items() if getattr(tok, "special", False))
        out = cls(tuple(table), special)
        return out if out._agrees_with(backend, n, whole_runs) else None

    def _agrees_with(self, backend: Any, n: int, whole_runs: bool) -> bool:
        """Every id (and one past the vocabulary) decoded after an anchor, specials kept
        and skipped, is the anchor's text plus the table's bytes. `whole_runs`: ids whose
        bytes are not UTF-8 by themselves are not checked (see `_piece_decoder`)."""
        anchor = next(
            (i for i in range(n) if i not in self.special and self.table[i].isalpha()), None
        )
        if anchor is None:
            return False
        ids = [*range(n), n]
        if whole_runs:
            ids = [i for i in ids if _is_utf8(self.join([i], False))]
        for skip in (False, True):
            head = backend.decode([anchor], skip_special_tokens=skip)
            got = backend.decode_batch([[anchor, i] for i in ids], skip_special_tokens=skip)
            for i, text in zip(ids, got):
                want = head + self.join([i], skip).decode("utf-8", errors="replace")
                if text != want:
                    return False
        return True


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _piece_decoder(decoder: dict | None) -> tuple[Callable[[str], bytes | None], bool] | None:
    """(piece (vocabulary string) -> bytes, whole_runs) for the decoders whose output is
    the bytes of the pieces concatenated; None for any other decoder.

    whole_runs: `tokenizers`' ByteFallback replaces a run of byte tokens that is not valid
    UTF-8 by one U+FFFD per token, where the stream (Python's rule) gives one per maximal
    invalid subsequence; valid text is the same. Byte-level BPE replaces as Python does."""
    if decoder is None:
        return None
    if decoder.get("type") == "ByteLevel":
        chars = _gpt2_byte_decoder()

        def byte_level(piece: str) -> bytes | None:
            try:
                return bytes(chars[c] for c in piece)
            except KeyError:
                return None

        return byte_level, False
    if decoder.get("type") == "Sequence" and _is_metaspace_fallback(decoder["decoders"]):

        def metaspace(piece: str) -> bytes:
            m = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace(METASPACE, " ").encode()

        return metaspace, True
    return None


def _is_metaspace_fallback(steps: list[dict]) -> bool:
    """Replace(U+2581 -> " "), ByteFallback, Fuse and a Strip of one leading space (which
    only touches a sequence's first token: the stream decodes after prompt context)."""
    kinds = [s.get("type") for s in steps]
    if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or kinds[3:] not in ([], ["Strip"]):
        return False
    pattern, content = steps[0].get("pattern", {}).get("String"), steps[0].get("content")
    return pattern == METASPACE and content == " "
