"""What the interpreter needs from a backend: tokenize, generate, score continuations.

Both backends tokenize on the client side with the model's tokenizer and send token ids,
so one program produces the same prompts (and, greedy, the same text) on both.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams
from radixrt.stats import CachePressure

from ..chat import ChatTemplate

DeltaCallback = Callable[[str], None]  # receives generated text as it arrives


def adapter_kw(lora: str | None) -> dict[str, str]:
    """The keyword a call passes to a Backend's methods to run under LoRA adapter `lora`
    (`lora=name`); none for the base model, so backends that serve no adapters (and wrappers
    that forward three arguments) keep their signatures."""
    return {} if lora is None else {"lora": lora}


@dataclass
class GenResult:
    text: str  # generated text (stop string excluded)
    output_ids: list[int]  # generated token ids
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    # log-probs of prompt tokens [logprob_start_len, prompt_tokens), when asked
    prompt_logprobs: list[float] = field(default_factory=list)
    rid: str | None = None  # the backend's request id (for `release_cache_holds`)


class Backend(ABC):
    """A model behind the DSL. Methods block until their result is ready and may be called
    from many threads at once (that is how forks and run_batch run concurrently)."""

    tokenizer: Any  # the model's HF fast tokenizer
    # whether `release_cache_holds` ends holds early: then a program holds its context between
    # its calls by default (radixrt.frontend.program.PROGRAM_CACHE_TTL_S) and releases it at
    # its end; without it only an explicit `cache_ttl_s` holds (the holds expire on time)
    releases_holds: bool = False
    # whether the runtime holds back a request whose uncached prefix another in-flight request
    # computes until that prefix is cached (radixrt.config.holds_back_shared_prefixes): then a
    # fork's branches go out with its prefix hint, not after it, and still compute it once
    holds_back_shared_prefixes: bool = False

    @abstractmethod
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_delta: DeltaCallback | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> GenResult:
        """Generate from `prompt_ids` with `options` (cache salt, priority, retention);
        `on_delta` (if given) gets text pieces as they arrive (their concatenation is the
        result's text). Backends that serve LoRA adapters take `lora=name` too (`adapter_kw`).
        Raises ValueError for input the model rejects, BackendError when the backend cannot
        serve; an adapter that is not loaded raises radixrt.lora.UnknownLora in process and a
        BackendError (HTTP 404) naming it over HTTP."""

    @abstractmethod
    def score_continuations(
        self, prefix_ids: list[int], continuations: list[list[int]], cache_salt: str | None = None
    ) -> list[list[float]]:
        """Log-prob of each continuation token given prefix + the continuation's earlier
        tokens: one list per continuation, all scored in one batched submission with
        max_tokens=0 and logprob_start_len = len(prefix_ids), under `cache_salt`. Send the
        prefix first (`cache_prefix`) so every continuation reuses its cached KV. `lora=name`
        as in `generate`."""

    def cache_prefix(
        self,
        prompt_ids: list[int],
        cache_salt: str | None = None,
        cache_ttl_s: float = 0.0,
        **adapter: str,
    ) -> GenResult:
        """Prefill `prompt_ids` without generating (max_tokens=0) so the prefix cache holds
        them (under `cache_salt`, and `lora=name` as in `generate`) for the requests that
        follow; `cache_ttl_s` > 0: held that long (a retention hint; the result's `rid`
        releases it)."""
        options = RequestOptions(cache_salt=cache_salt, cache_ttl_s=cache_ttl_s)
        return self.generate(prompt_ids, SamplingParams(max_tokens=0), options=options, **adapter)

    def release_cache_holds(self, rids: list[str]) -> None:  # noqa: B027 (optional)
        """End the retention holds (`cache_ttl_s`) of finished requests `rids` early (a
        program ended). By default nothing: the holds end when their time runs out."""

    def cache_pressure(self) -> CachePressure | None:
        """The engine's retention holds against its KV pool after its latest step (plain
        data, without waiting for the engine), for `run_batch` to start only as many programs
        as their held contexts fit; None where the backend cannot tell (then run_batch starts
        every program at once)."""
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt: special tokens (BOS) are added unless the text already
        starts with the BOS token (chat templates that render it)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        return self.tokenizer.encode(text, add_special_tokens=add_special)

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of text that follows a prompt (no special tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate(self.tokenizer)

    def close(self) -> None:  # noqa: B027 (optional hook, nothing to release by default)
        """Release what the backend holds (threads, engines it owns). Idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
