"""Length limits shared by the in-process Engine and the server (one rule, one place).

The rule (vLLM's): a prompt must leave room for at least one new token; an explicit
max_tokens must fit beside the prompt; an absent one (None) means all the room left.
"""

from __future__ import annotations

import logging

from radixrt.errors import RequestValueError

logger = logging.getLogger(__name__)


def resolve_max_model_len(
    requested: int | None, max_position_embeddings: int, sliding_window: int | None
) -> int:
    """The served context length: `requested`, else the model's max_position_embeddings;
    with a sliding window in force (ModelConfig.sliding_window; every layer here attends the
    whole context) at most the window: a default is clamped to it (and logged), a larger
    explicit one is refused (ValueError naming the field)."""
    length = requested or max_position_embeddings
    if sliding_window is None or length <= sliding_window:
        return length
    if requested is not None:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's sliding_window={sliding_window}, "
            "and sliding-window attention is not implemented: serve at most "
            f"{sliding_window} tokens (max_model_len <= {sliding_window})"
        )
    logger.warning(
        "sliding_window=%d is in force and not implemented: max_model_len clamped from %d "
        "to %d (within the window every layer attends the whole context, as the model does)",
        sliding_window, length, sliding_window,
    )  # fmt: skip
    return sliding_window


def resolve_max_tokens(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    default: int | None = None,
    *,
    prompt: str = "the prompt",
    prompt_param: str | None = None,
    max_tokens_param: str = "max_tokens",
) -> int:
    """New tokens the request may generate: an explicit `max_tokens`, else the room left (at
    most `default`). Raises RequestValueError naming the lengths and the field at fault
    (`prompt`: how the message names the prompt; the params: the request's field names)."""
    if prompt_len < 1:
        raise RequestValueError(f"{prompt} is empty: at least one token is needed", prompt_param)
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestValueError(
            f"{prompt} has {prompt_len} tokens but the context length is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens leave room for a new token",
            prompt_param,
        )
    if max_tokens is None:
        return room if default is None else min(room, default)
    if max_tokens > room:
        raise RequestValueError(
            f"{max_tokens_param}={max_tokens} does not fit: this model's maximum context length "
            f"is {max_model_len} tokens, and {prompt_len + max_tokens} were requested "
            f"({prompt_len} in {prompt} + {max_tokens}); at most {room} new tokens fit",
            max_tokens_param,
        )
    return max_tokens


def group_blocks_needed(
    prompt_len: int, max_tokens: int, num_seqs: int, block_size: int, max_model_len: int
) -> int:
    """KV blocks `num_seqs` sequences of one prompt need at most when they share the
    prompt's full blocks (all but the last prompt token: the fork point of n > 1 and beam
    search) and each grows to prompt_len + max_tokens (capped by the context length)."""
    total = min(prompt_len + max_tokens, max_model_len)
    shared = max(prompt_len - 1, 0) // block_size if num_seqs > 1 else 0
    return shared + num_seqs * (-(-total // block_size) - shared)


def check_fits(
    prompt_len: int,
    max_tokens: int,
    num_seqs: int,
    field_name: str,
    *,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
) -> None:
    """RequestValueError (naming `field_name` when num_seqs > 1) unless `num_seqs` sequences
    of one prompt sharing its full blocks (all but the last prompt token) fit in the engine's
    `num_slots` and its pool of `num_blocks` together."""
    if num_seqs > num_slots:
        raise RequestValueError(
            f"invalid {field_name}={num_seqs}: the engine runs at most "
            f"{num_slots} sequences at once (max_running_requests)",
            field_name or None,
        )
    blocks = group_blocks_needed(prompt_len, max_tokens, num_seqs, block_size, max_model_len)
    if blocks > num_blocks:
        what = f"{field_name}={num_seqs} sequences of " if num_seqs > 1 else ""
        raise RequestValueError(
            f"{what}prompt + max_tokens need {blocks} KV blocks but the pool has only "
            f"{num_blocks}; shorten the prompt or lower max_tokens"
            + (f" or {field_name}" if num_seqs > 1 else ""),
            field_name if num_seqs > 1 else "max_tokens",
        )
