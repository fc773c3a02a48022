"""The tiny models' tokenizer: byte-level BPE trained on the shipped text, special tokens
with fixed ids, and a chat template. Deterministic: the same text gives the same file."""

from __future__ import annotations

import functools
import json
import os
import tempfile

from radixrt.model import tiny_data

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS, END_OF_TURN)  # ids 0..6 in this order
PAD_ID, BOS_ID, EOS_ID, END_OF_TURN_ID = 0, 1, 2, 6
EOS_IDS = [EOS_ID, END_OF_TURN_ID]  # generation stops at either

# "<|role|>\ncontent<|end|>\n" per message; add_generation_prompt appends "<|assistant|>\n".
# OpenAI's `developer` role is the system role (rendered as <|system|>).
# Tools (OpenAI's `tools`) come first in a system turn; an assistant's calls follow its
# content in the Hermes format (`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`,
# "\n" between calls) and a tool message is a user turn `<tool_response>\n...\n</tool_response>`
# (Qwen2.5's layout): radixrt.server.tools.hermes parses and constrains the same text.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|system|>\\n# Tools\\nYou may call these functions:\\n<tools>\\n' }}"
    "{%- for tool in tools -%}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\\n' }}"
    "{%- endfor -%}"
    '{{ \'</tools>\\nTo call one, write <tool_call>\\n{"name": <name>, "arguments": '
    "<arguments object>}\\n</tool_call><|end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}"
    "{%- if role == 'tool' -%}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{%- else -%}"
    "{%- if role not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role ' + message['role']"
    " + '; allowed: system (or developer), user, assistant, tool') }}"
    "{%- endif -%}"
    "{{ '<|' + role + '|>\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{ '\\n' if not loop.first else '' }}"
    "{{ '<tool_call>\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def write_tiny_tokenizer(
    out_dir: str, *, vocab_size: int = 2048, model_max_length: int = 2048
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`; return the vocab size.

    Byte-level BPE (any UTF-8 text round-trips through encode/decode), no normalizer, no
    BOS added by `encode`; special tokens `SPECIAL_TOKENS` take ids 0..6.
    """
    tokenizer_json, actual_vocab_size = trained_tokenizer_json(vocab_size)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, sort_keys=True)
        f.write("\n")
    return actual_vocab_size


def refresh_chat_template(model_dir: str) -> None:
    """Rewrite `model_dir`'s tokenizer_config.json with the current `CHAT_TEMPLATE` when it
    holds another (a tiny model built before the template changed; its weights do not
    depend on it): atomically, so concurrent readers see the old file or the new one. A dir
    without the file is left as it is."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("chat_template") == CHAT_TEMPLATE:
        return
    config["chat_template"] = CHAT_TEMPLATE
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer_config-", dir=model_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


@functools.cache
def trained_tokenizer_json(vocab_size: int) -> tuple[str, int]:
    """Train the byte-level BPE on the shipped text (deterministic, ~0.2 s).

    Returns (tokenizer.json text, vocab size including special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special "
            f"tokens), got {vocab_size}"
        )
    corpus = tiny_data.tokenizer_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([corpus], trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer.to_str(pretty=True), tokenizer.get_vocab_size()
