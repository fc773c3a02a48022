"""HF references for the LoRA tests: greedy tokens and their log-probs from a PEFT model."""

from __future__ import annotations

import torch


def peft_greedy(model, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """`max_new` greedy tokens after `ids` and their log-probs (HF generate, its KV cache)."""
    x = torch.tensor([ids])
    # no end-of-sequence token at all, as ignore_eos: min_new_tokens would instead mask the
    # EOS ids out of the logits and pick another token where greedy picks one
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(ids) :].tolist()
    scores = [float(torch.log_softmax(step[0].double(), -1)[t]) for step, t in zip(out.logits, new)]
    return new, scores
