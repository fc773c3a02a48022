"""The check that a draft model can draft for a target: the same vocabulary and tokenizer."""

from __future__ import annotations

from radixrt.config import ModelConfig


def check_draft_compatible(
    target_path: str, draft_path: str, target: ModelConfig, draft: ModelConfig
) -> None:
    """Raise ValueError unless the draft shares the target's vocabulary and tokenizer (the
    same vocab_size and, where either dir has a tokenizer, the same token -> id map)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"speculative_draft_model {draft_path!r} has vocab_size {draft.vocab_size}, the "
            f"target {target_path!r} has {target.vocab_size}: a draft model must share the "
            "target's tokenizer and vocabulary"
        )
    import os

    has = [os.path.isfile(os.path.join(p, "tokenizer.json")) for p in (target_path, draft_path)]
    if not any(has):
        return  # dummy checkpoints (config only): the vocab size is all there is to compare
    if not all(has):
        raise ValueError(
            f"only one of the target {target_path!r} and speculative_draft_model "
            f"{draft_path!r} has a tokenizer.json: cannot check that they share a tokenizer"
        )
    from radixrt.hf_dir import load_tokenizer

    a, b = load_tokenizer(target_path).get_vocab(), load_tokenizer(draft_path).get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(
            f"speculative_draft_model {draft_path!r} has a different tokenizer than the target "
            f"{target_path!r} ({len(a)} vs {len(b)} tokens; differing entries e.g. {diff})"
        )
