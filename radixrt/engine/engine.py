"""Engine: the in-process API (used directly and by the frontend DSL): EngineCore's loop plus a
tokenizer, incremental detokenizers and stop strings."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from radixrt.config import ModelConfig, resolve_config
from radixrt.deltas import FinishReason, RequestDelta
from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.engine.core import EngineCore
from radixrt.lora import LoraInUse, LoraRegistry
from radixrt.plan import Runner
from radixrt.sampling import (
    DEFAULT_OPTIONS,
    BeamSearchParams,
    LoraRef,
    RequestOptions,
    SamplingParams,
)
from radixrt.scheduler.request import fork_rid
from radixrt.stats import CachePressure
from radixrt.token_bytes import TokenBytes

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    rid: str
    prompt: str | None  # the prompt text, when the request was given as text
    text: str  # generated text (stop string excluded)
    token_ids: list[int]  # generated token ids
    finish_reason: FinishReason | None  # stop | length | abort; None while running
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    logprobs: list[float] = field(default_factory=list)  # when SamplingParams.logprobs
    # when SamplingParams.top_logprobs: per token, the most likely (token id, log-prob)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # when SamplingParams.prompt_logprobs: prompt tokens [logprob_start_len, prompt_tokens)
    prompt_logprobs: list[float] = field(default_factory=list)
    index: int = 0  # which of the prompt's SamplingParams.n samples (choice index)
    error: str | None = None  # with FinishReason.ERROR: why (e.g. a grammar that does not
    # compile; then `invalid_request`)
    invalid_request: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated token ids (a final EOS included)
    text: str
    cumulative_logprob: float  # sum of the generated tokens' log-probs
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty (ranks the beams)


@dataclass
class BeamSearchOutput:
    rid: str
    prompt: str | None  # the prompt text, when given as text
    prompt_tokens: int
    sequences: list[BeamSequence]  # beam_width of them, best score first ([] when aborted)
    finish_reason: FinishReason  # the best sequence's: stop (EOS) or length; abort


@dataclass
class StreamDelta:
    rid: str
    index: int  # position of the prompt in the generate call
    text: str  # new text since the last delta
    token_ids: list[int]  # new token ids since the last delta
    finish_reason: FinishReason | None  # set on the request's last delta
    choice: int = 0  # which of the prompt's n samples (SamplingParams.n)


class Engine:
    """Generate text in-process.

    >>> engine = Engine("path/to/model", prefix_cache="radix")
    >>> engine.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "auto",
        *,
        runner: Runner | None = None,
        tokenizer: str | None = None,
        revision: str | None = None,
        **options: object,
    ) -> None:
        """`model_path`: an HF dir, a GGUF file or a hub id (`radixrt.hf_dir.resolve_model`,
        with `tokenizer` and `revision`). `runner` replaces the model runner (a scripted one:
        simulations, which then give the `num_kv_blocks` option)."""
        from radixrt.hf_dir import check_model_dir, load_tokenizer, resolve_model

        model_path = resolve_model(model_path, tokenizer=tokenizer, revision=revision)
        check_model_dir(model_path, require_weights=options.get("load_format") != "dummy")
        cfg = resolve_config(model_path, device, dtype, **options)
        model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = load_tokenizer(model_path)
        eos = model_config.stop_token_ids(self.tokenizer.eos_token_id)
        self.core = EngineCore(
            cfg, model_config, eos, runner=runner, num_kv_blocks=cfg.cache.num_kv_blocks
        )
        self._token_bytes = TokenBytes.build(self.tokenizer)  # None: decode by windows
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # LoRA adapters by name (radixrt.lora); `lora_modules` are loaded now
        self.loras = LoraRegistry(model_config, cfg.lora.max_lora_rank)
        for name, path in cfg.lora.modules():
            self.load_lora(name, path)

    config = property(lambda self: self.core.config)
    model_config = property(lambda self: self.core.model_config)
    scheduler = property(lambda self: self.core.scheduler)
    allocator = property(lambda self: self.core.allocator)
    cache = property(lambda self: self.core.cache)
    max_model_len = property(lambda self: self.core.max_model_len)

    # ---- LoRA adapters ----
    def load_lora(self, name: str, path: str) -> LoraRef:
        """Serve the PEFT adapter at `path` as `name` (radixrt.lora.LoraRegistry.load; a
        LoraLoadError names the field at fault). Needs max_loras > 0."""
        if not self.config.lora.enabled:
            raise ValueError("LoRA is off: start the engine with max_loras > 0")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`: UnknownLora if it is not loaded, LoraInUse (naming
        them) while requests use it."""
        ref = self.loras.resolve(name)
        users = self.core.requests_using_lora(ref.key)
        if users:
            raise LoraInUse(name, users)
        self.loras.unload(name)

    def with_lora(self, options: RequestOptions, lora: str | None) -> RequestOptions:
        """`options` running under adapter `lora` (None: unchanged). UnknownLora if it is not
        loaded."""
        if lora is None:
            return options
        return replace(options, lora=self.loras.resolve(lora))

    # ---- low level: add / step / abort ----
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        rid: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> str:
        """Queue one request with `options` (cache salt, priority, retention, a resolved LoRA
        adapter: `with_lora`); returns its id. Raises ValueError on bad input. With n > 1
        its outputs come as n requests `fork_rid(rid, i)` (deltas name `parent_rid`, `index`);
        aborting `rid` aborts them all."""
        rid = self.core.add_request(prompt_ids, params, rid, options=options)
        for r in [rid] if params.n == 1 else [fork_rid(rid, i) for i in range(params.n)]:
            self._detok[r] = IncrementalDetokenizer.for_params(
                self.tokenizer, params, list(prompt_ids), self._token_bytes
            )
        return rid

    def step(self) -> list[tuple[RequestDelta, str]]:
        """Run one engine step. Returns (delta, new text) for each request that changed;
        a request's last delta has `finish_reason` set (a stop string ends it with STOP)."""
        out = []
        for delta in self.core.step():
            if delta.beams is not None:  # beam search: texts are made by beam_search()
                out.append((delta, ""))
                continue
            detok = self._detok.get(delta.rid)
            if detok is None:  # a child the caller aborted itself after its group
                out.append((delta, ""))
                continue
            text = detok.add(delta.new_token_ids, final=delta.finished)
            if detok.stopped and not delta.finished:
                last = self.core.abort(delta.rid, FinishReason.STOP)
                delta.finish_reason = last.finish_reason
                delta.prompt_logprobs = last.prompt_logprobs
            if delta.finished:
                del self._detok[delta.rid]
            out.append((delta, text))
        return out

    def abort(self, rid: str) -> None:
        """Abort a request (the id of an n > 1 request aborts every child; their last deltas
        come with the next step)."""
        self.core.abort(rid)
        self._detok.pop(rid, None)

    # ---- batch API ----
    def _requests(self, prompts, sampling_params, prompt_token_ids, lora=None, options=None):
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
        loras = [lora] * n if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA adapters for {n} prompts")
        if options is None:
            options = DEFAULT_OPTIONS
        opts = [options] * n if isinstance(options, RequestOptions) else list(options)
        if len(opts) != n:
            raise ValueError(f"got {len(opts)} request options for {n} prompts")
        opts = [self.with_lora(o, name) for o, name in zip(opts, loras)]
        return texts, prompt_token_ids, params, opts

    def generate_stream(
        self, prompts=None, sampling_params=None, prompt_token_ids=None, lora=None, options=None
    ) -> Iterator[StreamDelta]:
        """Like `generate`, but yields text deltas as tokens arrive (any request order)."""
        texts, ids, params, opts = self._requests(
            prompts, sampling_params, prompt_token_ids, lora, options
        )
        yield from self._run(ids, params, opts, {})

    def generate(
        self, prompts=None, sampling_params=None, prompt_token_ids=None, lora=None, options=None
    ) -> list[RequestOutput]:
        """Generate for a batch of prompts (text or token ids); one SamplingParams for all
        or one per prompt; `lora`: a loaded adapter's name for all, or a name (or None: the
        base model) per prompt; `options`: one RequestOptions (cache salt, priority,
        retention) for all or one per prompt (None: the defaults). Returns outputs in prompt
        order; a prompt with SamplingParams.n > 1 contributes n consecutive outputs (`index`
        0..n-1; rid `fork_rid(rid, index)`). UnknownLora (nothing queued) for an adapter not
        loaded."""
        texts, ids, params, opts = self._requests(
            prompts, sampling_params, prompt_token_ids, lora, options
        )
        outs: dict[tuple[int, int], RequestOutput] = {}
        for delta in self._run(ids, params, opts, outs):
            out = outs[delta.index, delta.choice]
            out.text += delta.text
            out.token_ids += delta.token_ids
        for (i, _), out in outs.items():
            out.prompt = texts[i]
        return [outs[k] for k in sorted(outs)]

    def _run(
        self, ids, params, opts, outs: dict[tuple[int, int], RequestOutput]
    ) -> Iterator[StreamDelta]:
        """Add the requests, step until all finish, yield their deltas (and keep each
        output's RequestOutput in `outs`, keyed (prompt, choice), up to date but for text
        and token ids). A consumer that stops early aborts what is left (no KV leaks)."""
        index: dict[str, tuple[int, int]] = {}
        try:
            for i, (p, sp, o) in enumerate(zip(ids, params, opts)):
                rid = self.add_request(p, sp, options=o)
                for c in range(sp.n):
                    r = rid if sp.n == 1 else fork_rid(rid, c)
                    index[r] = (i, c)
                    outs[i, c] = RequestOutput(r, None, "", [], None, len(p), 0, 0, index=c)
            pending = set(index)
            while pending:
                for d, text in self.step():
                    if d.rid not in pending:
                        continue
                    out = outs[index[d.rid]]
                    out.finish_reason = d.finish_reason
                    out.completion_tokens = d.num_output_tokens
                    out.num_cached_tokens = d.num_cached_tokens
                    out.logprobs += d.new_logprobs
                    out.top_logprobs += d.new_top_logprobs
                    out.error, out.invalid_request = d.error, d.invalid_request
                    if d.finished:
                        out.prompt_logprobs = d.prompt_logprobs
                        pending.discard(d.rid)
                    i, c = index[d.rid]
                    yield StreamDelta(d.rid, i, text, d.new_token_ids, d.finish_reason, c)
        finally:
            for rid in index:
                if self.core.request(rid) is not None:
                    self.abort(rid)

    # ---- beam search ----
    def beam_search(
        self,
        prompts=None,
        params: BeamSearchParams | None = None,
        prompt_token_ids=None,
        lora=None,
        options=None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (text or token ids), all in the same batches:
        per prompt, `params.beam_width` sequences, best first (HF transformers'
        `generate(num_beams=W, do_sample=False)` semantics, early_stopping=False; see
        radixrt.scheduler.beam); `lora` and `options` as for `generate`. Raises ValueError
        on bad input (nothing is queued)."""
        params = params if params is not None else BeamSearchParams()
        texts, ids, _, opts = self._requests(prompts, None, prompt_token_ids, lora, options)
        rids: dict[str, int] = {}
        outs: dict[int, BeamSearchOutput] = {}
        try:
            for i, (p, o) in enumerate(zip(ids, opts)):
                rids[self.core.add_beam_search(p, params, options=o)] = i
            while len(outs) < len(rids):
                for d, _ in self.step():
                    if d.rid not in rids or d.beams is None:
                        continue
                    seqs = [
                        BeamSequence(
                            h.output_token_ids,
                            self.tokenizer.decode(
                                h.output_token_ids, skip_special_tokens=params.skip_special_tokens
                            ),
                            h.cumulative_logprob,
                            h.score,
                        )
                        for h in d.beams
                    ]
                    i = rids[d.rid]
                    outs[i] = BeamSearchOutput(
                        d.rid, texts[i], d.prompt_tokens, seqs, d.finish_reason
                    )
        finally:
            for rid in rids:
                if self.core.request(rid) is not None:
                    self.core.abort(rid)
        return [outs[i] for i in range(len(ids))]

    # ---- introspection ----
    def check_integrity(self) -> None:
        self.core.check_integrity()

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    def cache_pressure(self) -> CachePressure:
        """`EngineCore.cache_pressure()`: retention holds against the pool, now."""
        return self.core.cache_pressure()

    def shutdown(self) -> None:
        """Abort everything in flight and release the model and KV memory."""
        for rid in list(self.scheduler.requests):
            self.abort(rid)
        while self.core.has_work:  # a step still in flight
            self.core.step()
        self.core.shutdown()
        self.core.runner = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
