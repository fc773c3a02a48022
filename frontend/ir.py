"""The program expressions: text, gen, select and role blocks.

`s += expr` turns an expression into a flat list of operations (`to_ops`) that the
interpreter runs in order. Expressions concatenate with `+` ("Q: " + gen("a")).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from radixrt.sampling import RequestOptions, SamplingParams

ROLES = ("system", "user", "assistant", "tool")


class Expr:
    """Base of every program expression; `a + b` builds a sequence."""

    def __add__(self, other: ExprLike) -> Seq:
        return Seq((self, *_items(other)))

    def __radd__(self, other: ExprLike) -> Seq:
        return Seq((*_items(other), self))


ExprLike = str | Expr | Sequence["ExprLike"]


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class Seq(Expr):
    items: tuple[Expr | str, ...]

    def __add__(self, other: ExprLike) -> Seq:
        return Seq((*self.items, *_items(other)))


@dataclass(frozen=True)
class GenParams:
    """Sampling and request options of one gen; None means "the program default, else
    SamplingParams' / RequestOptions'"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool | None = None
    regex: str | None = None  # structured output: the text matches this regex ...
    json_schema: str | None = None  # ... or is JSON valid under this schema (a dict is
    # kept as canonical JSON text)
    logit_bias: tuple[tuple[int, float], ...] | None = None  # token id -> added to its logit
    cache_salt: str | None = None  # shares cached KV only with requests of this salt
    priority: int | None = None  # lower runs first (vLLM's convention)
    cache_ttl_s: float | None = None  # keep the context cached this long after the gen
    # the LoRA adapter's name (a loaded one); None: the program's (gen_defaults), else the base
    lora: str | None = None

    def __post_init__(self) -> None:
        _check_lora(self.lora, "gen")
        if isinstance(self.json_schema, dict):
            object.__setattr__(
                self, "json_schema", SamplingParams(json_schema=self.json_schema).json_schema
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", SamplingParams(logit_bias=self.logit_bias).logit_bias
            )
        self.resolve(None)  # validate now, where the user wrote gen(...)
        self.options(None)

    def set_values(self) -> dict[str, object]:
        """The options that are set (not None)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def resolve(self, defaults: GenParams | None) -> SamplingParams:
        """SamplingParams from these values over `defaults` over BASE_GEN_DEFAULTS.
        Raises ValueError (SamplingParams' message) for an invalid value."""
        values = self._values(defaults)
        return SamplingParams(**{k: v for k, v in values.items() if k not in _OPTION_NAMES})

    def options(self, defaults: GenParams | None) -> RequestOptions:
        """RequestOptions (cache salt, priority, retention) from these values over
        `defaults`. Raises ValueError (RequestOptions' message) for an invalid value."""
        values = self._values(defaults)
        return RequestOptions(**{k: v for k, v in values.items() if k in _OPTION_NAMES})

    def _values(self, defaults: GenParams | None) -> dict[str, object]:
        values = dict(BASE_GEN_DEFAULTS)
        if defaults is not None:
            values.update(defaults.set_values())
        values.update(self.set_values())
        values.pop("lora", None)  # an adapter's name, resolved by the backend (`adapter`)
        return values

    def adapter(self, defaults: GenParams | None) -> str | None:
        """The LoRA adapter of this gen: its own, else `defaults`' (None: the base model)."""
        if self.lora is not None or defaults is None:
            return self.lora
        return defaults.lora


BASE_GEN_DEFAULTS = {"max_tokens": 128}  # over SamplingParams' own defaults
_OPTION_NAMES = ("cache_salt", "priority", "cache_ttl_s")  # GenParams' RequestOptions fields


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None  # variable that receives the generated text; None: not stored
    params: GenParams
    # calls of the offered tools: "auto", "required" or a tool's name; None: plain text
    tool_choice: str | None = None
    parallel_tool_calls: bool = True  # more than one call allowed


@dataclass(frozen=True)
class OfferTools(Expr):
    tools: tuple[dict, ...]  # OpenAI-style definitions, rendered by the chat template


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    normalize: bool  # score = mean token log-prob (True) or their sum (False)
    lora: str | None = None  # the LoRA adapter's name; None: the program's, else the base


@dataclass(frozen=True)
class Role(Expr):
    role: str
    content: tuple[Expr | str, ...]
    call_id: str | None = None  # a tool message: the call it answers


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str
    call_id: str | None = None


Op = Text | Gen | Select | RoleBegin | RoleEnd | OfferTools


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    ignore_eos: bool | None = None,
    stop_token_ids: Sequence[int] | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    logit_bias: dict[int, float] | None = None,
    cache_salt: str | None = None,
    priority: int | None = None,
    cache_ttl_s: float | None = None,
    tool_choice: str | None = None,
    parallel_tool_calls: bool = True,
    lora: str | None = None,
) -> Gen:
    """Generate text at this point of the program and store it in variable `name`.
    Unset options come from `run(..., gen_defaults=...)`, else SamplingParams' defaults
    (max_tokens 128, temperature 1.0). `regex` / `json_schema` (at most one) constrain the
    text (structured output: it stops when the regex / JSON is complete). `logit_bias`
    ({token id: bias}) is added to those tokens' logits at every step. `cache_salt`
    (vLLM's): the gen shares cached KV only with requests of the same salt (set it for a
    whole program with `gen_defaults={"cache_salt": ...}`); `priority`: lower runs first;
    `cache_ttl_s`: keep the context cached this long after the gen finishes (e.g. while a
    tool runs before the next gen extends it). `tool_choice` ("auto", "required" or a tool's
    name) lets the model call the tools offered with `tools(...)`, constrained to calls whose
    arguments match their schemas (auto: once a call starts, in formats with a call marker);
    the variable holds the text outside calls and `state.tool_calls(name)` the calls.
    `lora`: run under this loaded LoRA adapter (by name; for a whole program:
    `gen_defaults={"lora": ...}`). Raises ValueError for an invalid value."""
    _check_name(name, "gen")
    params = GenParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=stop,  # type: ignore[arg-type]
        stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,  # type: ignore[arg-type]
        logit_bias=logit_bias,  # type: ignore[arg-type]
        cache_salt=cache_salt,
        priority=priority,
        cache_ttl_s=cache_ttl_s,
        lora=lora,
    )
    if tool_choice is not None and not (isinstance(tool_choice, str) and tool_choice):
        raise ValueError(f"gen({name!r}) tool_choice must be auto, required or a tool's name")
    return Gen(name, params, tool_choice, bool(parallel_tool_calls))


def tools(definitions: Sequence[dict]) -> OfferTools:
    """Offer functions to the model (OpenAI `tools` entries, or bare {"name", "parameters"}
    objects): the chat template renders them; add it before the first role."""
    from .tool_calls import normalized_tools

    return OfferTools(normalized_tools(list(definitions)))


def tool_result(call_id: str, *content: ExprLike) -> Role:
    """A tool message answering call `call_id` (an id from `state.tool_calls(...)`)."""
    return Role("tool", tuple(x for c in content for x in _items(c)), call_id)


def select(
    name: str | None, choices: Sequence[str], normalize: bool = True, lora: str | None = None
) -> Select:
    """Append the choice the model finds most likely after the text so far and store it in
    `name`. Each choice is scored by the log-probs of its tokens (tokenized on its own,
    after the separately tokenized prefix): their mean (normalize=True) or sum. Ties go to
    the first choice. `lora`: score under this loaded LoRA adapter (None: the program's,
    `gen_defaults={"lora": ...}`, else the base model). Raises ValueError for no choices or
    an empty choice."""
    _check_name(name, "select")
    _check_lora(lora, "select")
    if isinstance(choices, str) or not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices, got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}) choices must be non-empty strings, got {choices!r}")
    return Select(name, tuple(choices), bool(normalize), lora)


def role(name: str, *content: ExprLike) -> Role:
    """A chat message of role `name`, rendered with the model's chat template."""
    if name not in ROLES:
        raise ValueError(f"unknown role {name!r}; allowed: {', '.join(ROLES)}")
    return Role(name, tuple(x for c in content for x in _items(c)))


def system(*content: ExprLike) -> Role:
    return role("system", *content)


def user(*content: ExprLike) -> Role:
    return role("user", *content)


def assistant(*content: ExprLike) -> Role:
    return role("assistant", *content)


def to_ops(expr: ExprLike) -> list[Op]:
    """Flatten an expression into the operations the interpreter runs, in order."""
    if isinstance(expr, str):
        return [Text(expr)] if expr else []
    if isinstance(expr, Seq):
        return [op for item in expr.items for op in to_ops(item)]
    if isinstance(expr, Role):
        body = [op for item in expr.content for op in to_ops(item)]
        if any(isinstance(op, RoleBegin) for op in body):
            raise ValueError(f"role {expr.role!r} contains another role; roles do not nest")
        return [RoleBegin(expr.role), *body, RoleEnd(expr.role, expr.call_id)]
    if isinstance(expr, (Text, Gen, Select, RoleBegin, RoleEnd, OfferTools)):
        return [expr] if not (isinstance(expr, Text) and not expr.value) else []
    if isinstance(expr, (list, tuple)):
        return [op for item in expr for op in to_ops(item)]
    raise ValueError(
        f"cannot add {type(expr).__name__} to a program state; allowed: str, gen(...), "
        "select(...), system/user/assistant(...), or a + / list of those"
    )


def _items(x: ExprLike) -> tuple[Expr | str, ...]:
    if isinstance(x, Seq):
        return x.items
    if isinstance(x, (list, tuple)):
        return tuple(i for item in x for i in _items(item))
    if isinstance(x, (str, Expr)):
        return (x,)
    raise ValueError(f"cannot concatenate {type(x).__name__} with a program expression")


def _check_name(name: object, what: str) -> None:
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"{what} variable name must be a non-empty string or None, got {name!r}")


def _check_lora(lora: object, what: str) -> None:
    if lora is not None and not (isinstance(lora, str) and lora):
        raise ValueError(f"{what}() lora must be a loaded adapter's name, got {lora!r}")
