"""Engine: the in-process API (used directly, by the frontend DSL, and inside the server's
scheduler process). The loop is `batch = scheduler.schedule()`, `runner.forward(batch)`,
`scheduler.update(batch, tokens)`."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from radixrt.config import ModelConfig, resolve_config
from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.engine.core import EngineCore
from radixrt.sampling import SamplingParams
from radixrt.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    rid: str
    prompt: str | None  # the prompt text, when the request was given as text
    text: str  # generated text (stop string excluded)
    token_ids: list[int]  # generated token ids
    finish_reason: str | None  # stop | length | abort; None while running
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    logprobs: list[float] = field(default_factory=list)  # when SamplingParams.logprobs
    # when SamplingParams.prompt_logprobs: prompt tokens [logprob_start_len, prompt_tokens)
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    rid: str
    index: int  # position of the prompt in the generate call
    text: str  # new text since the last delta
    token_ids: list[int]  # new token ids since the last delta
    finish_reason: str | None  # set on the request's last delta


class Engine:
    """Generate text in-process.

    >>> engine = Engine("path/to/model", prefix_cache="radix")
    >>> engine.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(
        self, model_path: str, device: str = "auto", dtype: str = "auto", **options: object
    ) -> None:
        from radixrt.model.loader import check_model_dir, load_tokenizer

        check_model_dir(model_path, require_weights=options.get("load_format") != "dummy")
        cfg = resolve_config(model_path, device, dtype, **options)
        model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = load_tokenizer(model_path)
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.core = EngineCore(cfg, model_config, sorted(eos))
        self._detok: dict[str, IncrementalDetokenizer] = {}

    config = property(lambda self: self.core.config)
    model_config = property(lambda self: self.core.model_config)
    scheduler = property(lambda self: self.core.scheduler)
    allocator = property(lambda self: self.core.allocator)
    cache = property(lambda self: self.core.cache)
    max_model_len = property(lambda self: self.core.max_model_len)

    # ---- low level: add / step / abort ----
    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None
    ) -> str:
        """Queue one request; returns its id. Raises ValueError on bad input."""
        req = self.core.add_request(prompt_ids, params, rid)
        self._detok[req.rid] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens, req.token_ids
        )
        return req.rid

    def step(self) -> list[tuple[Request, str]]:
        """Run one scheduler step. Returns (request, new text) for each request that got
        tokens; finished requests have `finish_reason` set."""
        out = []
        for req in self.core.step():
            detok = self._detok[req.rid]
            new = req.output_ids[-1:] if req.num_output else []
            text = detok.add(new, final=req.is_finished)
            if detok.stopped and not req.is_finished:
                self.core.abort(req.rid, reason="stop")
            if req.is_finished:
                del self._detok[req.rid]
            out.append((req, text))
        return out

    def abort(self, rid: str) -> None:
        self.core.abort(rid)
        self._detok.pop(rid, None)

    # ---- batch API ----
    def _requests(self, prompts, sampling_params, prompt_token_ids):
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if (
            prompt_token_ids is not None
            and prompt_token_ids
            and isinstance(prompt_token_ids[0], int)
        ):
            prompt_token_ids = [prompt_token_ids]
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        if prompts is not None:
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        n = len(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * n
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return texts, prompt_token_ids, params

    def generate_stream(
        self, prompts=None, sampling_params=None, prompt_token_ids=None
    ) -> Iterator[StreamDelta]:
        """Like `generate`, but yields text deltas as tokens arrive (any request order)."""
        texts, ids, params = self._requests(prompts, sampling_params, prompt_token_ids)
        yield from self._run(ids, params, {})

    def generate(
        self, prompts=None, sampling_params=None, prompt_token_ids=None
    ) -> list[RequestOutput]:
        """Generate for a batch of prompts (text or token ids); one SamplingParams for all
        or one per prompt. Returns outputs in prompt order."""
        texts, ids, params = self._requests(prompts, sampling_params, prompt_token_ids)
        reqs: dict[int, Request] = {}
        text = [""] * len(ids)
        for delta in self._run(ids, params, reqs):
            text[delta.index] += delta.text
        return [
            RequestOutput(
                rid=req.rid,
                prompt=texts[i],
                text=text[i],
                token_ids=req.output_ids,
                finish_reason=req.finish_reason,
                prompt_tokens=req.prompt_len,
                completion_tokens=req.num_output,
                num_cached_tokens=req.num_cached_tokens,
                logprobs=list(req.output_logprobs),
                prompt_logprobs=list(req.prompt_logprobs),
            )
            for i, req in sorted(reqs.items())
        ]

    def _run(self, ids, params, reqs: dict[int, Request]) -> Iterator[StreamDelta]:
        """Add the requests, step until all finish, yield their deltas. A consumer that
        stops early aborts what is left (no KV leaks)."""
        index: dict[str, int] = {}
        try:
            for i, (p, sp) in enumerate(zip(ids, params)):
                rid = self.add_request(p, sp)
                index[rid] = i
                reqs[i] = self.scheduler.requests[rid]
            pending = set(index)
            while pending:
                for req, text in self.step():
                    if req.rid not in pending:
                        continue
                    new_ids = req.output_ids[-1:] if req.num_output else []
                    yield StreamDelta(req.rid, index[req.rid], text, new_ids, req.finish_reason)
                    if req.is_finished:
                        pending.discard(req.rid)
        finally:
            for rid in index:
                if rid in self.scheduler.requests:
                    self.abort(rid)

    # ---- introspection ----
    def check_integrity(self) -> None:
        self.core.check_integrity()

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    def shutdown(self) -> None:
        """Abort everything in flight and release the model and KV memory."""
        for rid in list(self.scheduler.requests):
            self.abort(rid)
        self.core.runner = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
