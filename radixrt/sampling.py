"""SamplingParams and BeamSearchParams: how one request picks its tokens and when it stops;
RequestOptions: how it is scheduled and cached (tenancy, priority, retention, LoRA adapter),
which rides beside them on the request envelope (vLLM's EngineCoreRequest does the same).

Every numeric field has a range, checked in `__post_init__` (a ValueError naming the field
and the range); the bounds are the constants below, for the HTTP schema and the docs:

    max_tokens            [0, MAX_INT] or None   top_k              [1, MAX_INT] or None
    temperature           [0, max float]; below GREEDY_TEMPERATURE greedy
    top_p                 (0, 1]                 min_p              [0, 1]
    repetition_penalty    [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
    presence_penalty      [-PENALTY_RANGE, PENALTY_RANGE], frequency_penalty the same
    logit_bias (a bias)   [-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE]
    seed                  [0, SEED_RANGE)        n                  [1, MAX_N]
    top_logprobs          [0, MAX_TOP_LOGPROBS]  logprob_start_len  [1, MAX_INT]
    stop_token_ids        [0, MAX_INT] each
    RequestOptions: priority [MIN_PRIORITY, MAX_PRIORITY], cache_salt 1..MAX_CACHE_SALT_CHARS
    chars, cache_ttl_s [0, MAX_CACHE_TTL_S]
    BeamSearchParams: beam_width [1, MAX_BEAM_WIDTH], max_tokens [1, MAX_INT],
    length_penalty [-LENGTH_PENALTY_RANGE, LENGTH_PENALTY_RANGE]

Integers fit the int64 of the msgpack messages between the server's processes and of the
sampler's tensors; vocabulary-dependent bounds (token ids, top_k <= vocab) are checked by
whoever knows the vocabulary (the server's request validation, `EngineCore.add_request`).
Within these ranges the sampler (radixrt/executor/sampler.py, float32) and the beam scorer
(radixrt/scheduler/beam.py, float64) compute every value: a temperature above float32's
largest number samples as that largest one (the uniform limit, ranked by the logits).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from radixrt.errors import RequestValueError
from radixrt.json_depth import MAX_JSON_DEPTH, text_depth_exceeds, value_depth_exceeds

MAX_INT = 2**31 - 1  # bound of token ids, top_k, max_tokens, logprob_start_len
SEED_RANGE = 2**63  # seeds are in [0, 2^63); derived seeds wrap modulo this
MAX_TOP_LOGPROBS = 20  # alternatives returned per generated token at most
LOGIT_BIAS_RANGE = 100.0  # a logit bias is in [-100, 100]
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): logits / T would overflow
# float32 for tiny T, and the distribution is the argmax's to float32 precision long before.
GREEDY_TEMPERATURE = 1e-5
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty are in [-2, 2] (OpenAI's range)
# repetition_penalty is in [0.01, 100]: a seen token's logit is divided or multiplied by at
# most 100 (the effect saturates long before: such a token is all but banned or forced);
# beyond, float32 logits overflow to inf or flush to 0 (at 1e-300 every positive logit is inf).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# length_penalty is in [-10, 10]: a beam's score is cumulative_logprob / length ** penalty in
# float64 (the scheduler's Python floats), and for every length up to MAX_INT < 2**31,
# length ** +-10 lies in [2**-310, 2**310], far inside float64's normal range, so the score is
# finite and never divides by zero (HF's default is 1.0; common values are in [0, 2]).
LENGTH_PENALTY_RANGE = 10.0
MAX_N = 64  # SamplingParams.n at most
MAX_BEAM_WIDTH = 10  # BeamSearchParams.beam_width at most (see BeamSearchParams)
MAX_GRAMMAR_CHARS = 64 * 1024  # regex / schema / EBNF text at most (the compile is costly)
# priority is in [-2^31, 2^31) (vLLM's int priority; lower runs first, default 0)
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
MAX_CACHE_SALT_CHARS = 1024  # a cache salt's length at most
MAX_CACHE_TTL_S = 86400.0  # cache_ttl_s at most (the engine caps it lower: retention_max_ttl_s)


@dataclass(frozen=True)
class LoraRef:
    """The LoRA adapter a request runs under, as a `radixrt.lora.LoraRegistry` resolved its
    name: clients name adapters, and this carries what the cache and the runner need."""

    name: str  # the adapter's served name
    key: str  # digest of its config and weights: the cache namespace's adapter field
    path: str  # its PEFT directory (the runner reads the weights from there)


@dataclass(frozen=True)
class RequestOptions:
    """How a request is scheduled and cached, beside its SamplingParams or BeamSearchParams
    (an n > 1 request's children and a beam search's beams share them)."""

    # Tenants: requests share cached KV only with requests of the same salt (None: unsalted);
    # the server puts a tenant's name in front of it (radixrt.server.tenants)
    cache_salt: str | None = None
    priority: int = 0  # admission / preemption order: lower first (vLLM's convention)
    # retention hint: keep the prompt cached this many seconds after the request finishes
    # (radixrt.scheduler.retention; 0: plain LRU)
    cache_ttl_s: float = 0.0
    # the LoRA adapter to run under (None: the base model); set from an adapter's name by
    # `Engine.generate(lora=...)` or the server, which resolve it in their registry
    lora: LoraRef | None = None

    def __post_init__(self) -> None:
        _check(
            _num(self.cache_ttl_s) and 0 <= self.cache_ttl_s <= MAX_CACHE_TTL_S,
            "cache_ttl_s",
            self.cache_ttl_s,
            f"a number of seconds in [0, {MAX_CACHE_TTL_S:g}]",
        )
        salt = self.cache_salt
        _check(
            salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS),
            "cache_salt",
            salt,
            f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, or None",
        )
        _check(
            _int_in(self.priority, MIN_PRIORITY, MAX_PRIORITY),
            "priority",
            self.priority,
            f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] (lower runs first)",
        )


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # new tokens to generate at most; None: all that fit
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 too): greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens (1: greedy); None: all
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob, in [0, 1]
    seed: int | None = None  # per-request RNG seed in [0, 2^63): the same seed reproduces
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    # (in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
    presence_penalty: float = 0.0  # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    stop: tuple[str, ...] = ()  # stop strings (output is cut before them)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    # regular expressions (Python `regex` syntax) whose first match in the output ends it
    stop_regex: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # keep the stop string / regex match in the text
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings ignored, before this
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    prompt_logprobs: bool = False  # return log p(prompt token i | tokens < i) ...
    logprob_start_len: int = 1  # ... for prompt indices i >= this (>= 1); the prefix cache
    # is used only below that point, so those tokens are computed
    logprobs: bool = False  # return the log-prob of each sampled token
    # with logprobs: also this many most likely (token id, log-prob) per sampled token
    top_logprobs: int = 0
    # (token id, bias) pairs added to the logits before sampling; each id once. A Mapping
    # {id: bias} is accepted and turned into pairs (sorted by id).
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1  # independent samples of the prompt (1..MAX_N): the prompt is prefilled
    # once and forked; child i samples with seed (seed + i) mod 2**63 when seeded
    # Structured output (at most one; see radixrt.grammar): the output must match
    regex: str | None = None  # this regular expression (whole output)
    json_schema: str | None = None  # this JSON schema (a dict is turned into canonical JSON)
    grammar: str | None = None  # this EBNF grammar (xgrammar / GBNF syntax, rule `root`)
    # this xgrammar structural tag (JSON text: {"type": "structural_tag", "format": ...});
    # tool calls in a model's format
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, Mapping):
            # checked first: json.dumps and repr recurse once per level
            _check(
                not value_depth_exceeds(self.json_schema),
                "json_schema",
                "{...}",
                f"a JSON object nested at most {MAX_JSON_DEPTH} levels deep",
            )
            try:
                text = json.dumps(self.json_schema, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError):
                text = None
            _check(text is not None, "json_schema", self.json_schema, "JSON-serialisable")
            object.__setattr__(self, "json_schema", text)
        _check_grammar(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop_regex, str):
            object.__setattr__(self, "stop_regex", (self.stop_regex,))
        else:
            object.__setattr__(self, "stop_regex", tuple(self.stop_regex))
        bias = self.logit_bias
        pairs = sorted(bias.items()) if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(_pair(p) for p in pairs))
        _check(
            self.max_tokens is None or _int_in(self.max_tokens, 0, MAX_INT),
            "max_tokens",
            self.max_tokens,
            _ints(0) + ", or None for as many as fit in the context",
        )
        _check(
            _num(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            f"a finite number >= 0 (below {GREEDY_TEMPERATURE:g} means greedy)",
        )
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            self.top_k is None or _int_in(self.top_k, 1, MAX_INT),
            "top_k",
            self.top_k,
            f"an integer in [1, {MAX_INT}], or None for no limit",
        )
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(
            self.seed is None or _int_in(self.seed, 0, SEED_RANGE - 1),
            "seed",
            self.seed,
            "an integer in [0, 2^63), or None",
        )
        _check(
            _num(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            self.repetition_penalty,
            f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _num(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE,
                name,
                value,
                f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]",
            )
        _check(
            _int_in(self.logprob_start_len, 1, MAX_INT),
            "logprob_start_len",
            self.logprob_start_len,
            _ints(1),
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            all(isinstance(r, str) and _compiles(r) for r in self.stop_regex),
            "stop_regex",
            self.stop_regex,
            "regular expressions that compile and match no empty string",
        )
        _check(_int_in(self.min_tokens, 0, MAX_INT), "min_tokens", self.min_tokens, _ints(0))
        _check(
            all(_int_in(t, 0, MAX_INT) for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"integers in [0, {MAX_INT}]",
        )
        _check(
            _int_in(self.top_logprobs, 0, MAX_TOP_LOGPROBS),
            "top_logprobs",
            self.top_logprobs,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        _check(
            self.n == 1 or not self.prompt_logprobs,
            "prompt_logprobs",
            self.prompt_logprobs,
            "False when n > 1 (score the prompt with an n = 1 request)",
        )
        _check(
            all(
                len(p) == 2
                and _int_in(p[0], 0, MAX_INT)
                and _num(p[1])
                and -LOGIT_BIAS_RANGE <= p[1] <= LOGIT_BIAS_RANGE
                for p in self.logit_bias
            )
            and len({p[0] for p in self.logit_bias}) == len(self.logit_bias),
            "logit_bias",
            self.logit_bias,
            f"(token id >= 0, bias in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]) pairs, "
            "each token id once",
        )

    @property
    def greedy(self) -> bool:
        """Whether the sample is the argmax: a temperature below GREEDY_TEMPERATURE, or
        top_k 1 (whatever the temperature)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search (deterministic; HF transformers' `generate(num_beams=beam_width,
    do_sample=False, early_stopping=False)` semantics, see radixrt/scheduler/beam.py).

    Each step ranks max(2, 1 + number of EOS ids) * beam_width candidates; the runner returns
    that many top log-probs per beam, which must stay <= MAX_TOP_LOGPROBS (so with 2 EOS ids
    beam_width <= 6, without EOS in play (ignore_eos) <= 10)."""

    beam_width: int = 4  # beams kept per step, 1..MAX_BEAM_WIDTH; also sequences returned
    max_tokens: int = 16  # new tokens per sequence at most, in [1, MAX_INT]
    # finished score = cumulative_logprob / length ** this, in [-10, 10] (LENGTH_PENALTY_RANGE)
    length_penalty: float = 1.0
    ignore_eos: bool = False  # EOS ids are plain tokens (every beam runs max_tokens)
    skip_special_tokens: bool = True  # leave special tokens out of the text

    def __post_init__(self) -> None:
        _check(
            _int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
            "beam_width",
            self.beam_width,
            f"an integer in [1, {MAX_BEAM_WIDTH}]",
        )
        _check(_int_in(self.max_tokens, 1, MAX_INT), "max_tokens", self.max_tokens, _ints(1))
        _check(
            _num(self.length_penalty)
            and -LENGTH_PENALTY_RANGE <= self.length_penalty <= LENGTH_PENALTY_RANGE,
            "length_penalty",
            self.length_penalty,
            f"in [-{LENGTH_PENALTY_RANGE:g}, {LENGTH_PENALTY_RANGE:g}] (1 = HF's default)",
        )

    def num_candidates(self, num_eos_ids: int) -> int:
        """Candidates ranked per step (HF's beams_to_keep)."""
        eos = 0 if self.ignore_eos else num_eos_ids
        return max(2, 1 + eos) * self.beam_width

    def check_candidates(self, num_eos_ids: int) -> None:
        """Raises ValueError when the model's EOS ids make the candidate count exceed what the
        runner returns per row."""
        k = self.num_candidates(num_eos_ids)
        _check(
            k <= MAX_TOP_LOGPROBS,
            "beam_width",
            self.beam_width,
            f"at most {MAX_TOP_LOGPROBS // max(2, 1 + num_eos_ids)} for a model with "
            f"{num_eos_ids} EOS ids (max(2, 1 + EOS ids) * beam_width <= {MAX_TOP_LOGPROBS})",
        )


STRUCTURED_FIELDS = ("regex", "json_schema", "grammar", "structural_tag")  # at most one


def _check_grammar(p: SamplingParams) -> None:
    """regex / json_schema / grammar: strings of bounded size, at most one set; a schema is a
    JSON object (or true/false)."""
    given = [n for n in STRUCTURED_FIELDS if getattr(p, n) is not None]
    _check(len(given) <= 1, given[-1] if given else "regex", given, "at most one of regex, "
           "json_schema, grammar and structural_tag")  # fmt: skip
    for name in given:
        value = getattr(p, name)
        _check(
            isinstance(value, str) and 0 < len(value) <= MAX_GRAMMAR_CHARS,
            name,
            value,
            f"a non-empty string of at most {MAX_GRAMMAR_CHARS} characters",
        )
    if p.json_schema is not None:
        _check(
            not text_depth_exceeds(p.json_schema),
            "json_schema",
            p.json_schema,
            f"a JSON object nested at most {MAX_JSON_DEPTH} levels deep",
        )  # before json.loads, which recurses once per level
        try:
            schema = json.loads(p.json_schema)
        except ValueError as e:
            _check(False, "json_schema", p.json_schema, f"a JSON object (not JSON: {e})")
        _check(isinstance(schema, (dict, bool)), "json_schema", p.json_schema, "a JSON object")


def _compiles(pattern: str) -> bool:
    """`pattern` is a non-empty regular expression (`regex` module) that compiles and does
    not match the empty string (which would end every output at once)."""
    import regex

    if not pattern or len(pattern) > MAX_GRAMMAR_CHARS:
        return False
    try:
        return regex.fullmatch(pattern, "") is None
    except (regex.error, RecursionError, OverflowError):
        return False


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: object) -> bool:
    """A finite int or float (not a bool, not NaN or infinite; an int fits an int64)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return abs(x) < SEED_RANGE if isinstance(x, int) else math.isfinite(x)


def _pair(p: object) -> tuple:
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)  # (p,) fails the check


def _int_in(x: object, lo: int, hi: int) -> bool:
    """An int (not a bool) in [lo, hi]."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _ints(lo: int) -> str:
    return f"an integer in [{lo}, {MAX_INT}]"


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise RequestValueError(f"invalid {name}={shown}: must be {allowed}", name)


# unsalted, priority 0, no retention, the base model (made once its checks are defined)
DEFAULT_OPTIONS = RequestOptions()
