"""Write tests/data/smollm2_reference.json: HF transformers' greedy answers (float32, CPU, its
own GGUF loading of the pinned SmolLM2 file) to the chats of tests/smollm2_prompts.py, with the
margin between the two top logits at each generated position, and prompt and top-5 log-probs
for the first few chats. tests/test_smollm2.py compares radixrt against this file.

    python tests/data/make_smollm2_reference.py   # a few minutes on two cores
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from smollm2_prompts import CHATS, LOGPROB_PROMPTS, NEW_TOKENS, TOP_LOGPROBS  # noqa: E402

from radixrt.hf_dir.smollm2 import GGUF_SHA256, fetch_smollm2  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_reference.json")


@torch.no_grad()
def greedy(model, ids: list[int], with_logprobs: bool) -> dict:
    """NEW_TOKENS greedy tokens (EOS ignored) with each step's top-2 logit margin."""
    out = model(torch.tensor([ids]), use_cache=True)
    entry: dict = {"prompt_ids": ids, "output_ids": [], "margins": []}
    if with_logprobs:
        lp = torch.log_softmax(out.logits[0, :-1].float(), -1)
        entry["prompt_logprobs"] = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        entry["top_logprobs"] = []
    past, logits = out.past_key_values, out.logits[0, -1]
    for _ in range(NEW_TOKENS):
        top = logits.float().topk(2)
        token = int(top.indices[0])
        entry["output_ids"].append(token)
        entry["margins"].append(float(top.values[0] - top.values[1]))
        if with_logprobs:
            best = torch.log_softmax(logits.float(), -1).topk(TOP_LOGPROBS)
            entry["top_logprobs"].append([[int(i), float(v)] for v, i in zip(*best)])
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return entry


def main() -> None:
    path = fetch_smollm2()
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    entries = []
    for i, chat in enumerate(CHATS):
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        entry = greedy(model, ids, with_logprobs=i < LOGPROB_PROMPTS)
        entries.append({"messages": chat, **entry})
        print(i, repr(tok.decode(entry["output_ids"][:24])), flush=True)
    with open(OUT, "w") as f:
        json.dump(
            {
                "gguf_sha256": GGUF_SHA256,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "new_tokens": NEW_TOKENS,
                "chats": entries,
            },
            f,
        )
        f.write("\n")


if __name__ == "__main__":
    main()
