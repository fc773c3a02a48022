"""Seeded multi-call workloads made of random token ids (nothing is downloaded).

A workload is a list of programs ("sessions"); a program is a tree of calls. A call starts
once its parent finished, and its prompt is the parent's prompt, then the parent's output
(unless `extends_output` is False), then the call's own `input_ids`. Outputs use
`ignore_eos` with a fixed `max_tokens`, so every configuration does the same work and all
lengths below are known before the run. Token ids are drawn from [FIRST_TOKEN, vocab).

| name            | program                                             | count key   |
|-----------------|-----------------------------------------------------|-------------|
| shared-prefix   | one call: group system prompt + question            | num_groups  |
| multi-turn      | chat: a turn = previous context + user input        | num_users   |
| agent           | ReAct loop: a step = previous context + observation | num_agents  |
|                 | (`tool_calls=True`: as tool calls and tool messages) |             |
| tree-of-thought | each node forks 3-4 branches after it finished      | num_trees   |
| few-shot        | prefill shots + question, then score each choice    | num_subjects|
| random          | one call, nothing shared (the cache's overhead)     | num_requests|
| long-history    | chats over 4-16k-token histories, short answers     | num_users   |

`long-history` (host KV tier benchmark) is not in the default suite (`DEFAULT_WORKLOADS`): its
conversations together hold more KV than a device pool, so without a host tier every turn
recomputes most of its history.

`SIZES[name]["full"]` is the full-size (GPU) shape, `["smoke"]` a CPU-sized one for the
tiny model; `scale` multiplies the count key.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

FIRST_TOKEN = 10  # ids below this are left out (special tokens of most tokenizers)


@dataclass(frozen=True)
class Call:
    parent: int | None  # index of the call this one extends (earlier in the program); None: root
    input_ids: tuple[int, ...]  # tokens appended after the parent's context (root: the prompt)
    max_tokens: int  # output tokens (ignore_eos: exactly this many); 0: prefill only
    extends_output: bool = True  # the prompt includes the parent's output (False: select)
    pause_s: float = 0.0  # the client sends it this long after the parent finished (a tool)


@dataclass(frozen=True)
class Program:
    calls: tuple[Call, ...]  # parents come before their children

    def prompt_lens(self) -> list[int]:
        """Prompt length of each call (outputs have exactly max_tokens tokens)."""
        lens: list[int] = []
        for call in self.calls:
            base = 0
            if call.parent is not None:
                parent = self.calls[call.parent]
                base = lens[call.parent] + (parent.max_tokens if call.extends_output else 0)
            lens.append(base + len(call.input_ids))
        return lens

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.calls]
        for i, call in enumerate(self.calls):
            if call.parent is not None:
                assert call.parent < i, "a call's parent must come before it"
                kids[call.parent].append(i)
        return kids

    def unique_tokens(self) -> int:
        """Tokens of the program's KV if every prefix is stored once (its tree's size)."""
        return sum(len(c.input_ids) + c.max_tokens for c in self.calls)


@dataclass(frozen=True)
class Workload:
    name: str
    programs: tuple[Program, ...]
    params: dict  # the generator's arguments (for the results JSON)

    @property
    def num_calls(self) -> int:
        return sum(len(p.calls) for p in self.programs)

    @property
    def prompt_tokens(self) -> int:
        return sum(sum(p.prompt_lens()) for p in self.programs)

    @property
    def output_tokens(self) -> int:
        return sum(c.max_tokens for p in self.programs for c in p.calls)

    @property
    def max_context(self) -> int:
        """Longest prompt + output of any call."""
        return max(
            n + c.max_tokens for p in self.programs for n, c in zip(p.prompt_lens(), p.calls)
        )

    def working_set_tokens(self, max_concurrency: int | None = None) -> int:
        """KV tokens that all programs running at once keep: the `max_concurrency` largest
        programs' trees (all programs when None)."""
        sizes = sorted((p.unique_tokens() for p in self.programs), reverse=True)
        return sum(sizes[:max_concurrency] if max_concurrency else sizes)

    def best_hit_rate(self) -> float:
        """Upper bound of sum(cached) / sum(prompt tokens) for an engine that caches the KV
        it computed: a call reuses its parent's context except the parent's last output
        token (sampled, never fed through the model, so it has no KV), a root the longest
        prefix it shares with an earlier root; a prompt's last token is always computed."""
        trie = PrefixTrie()
        cached = 0
        for program in self.programs:
            lens = program.prompt_lens()
            for i, call in enumerate(program.calls):
                if call.parent is None:
                    shared = trie.insert(call.input_ids)
                else:
                    shared = lens[i] - len(call.input_ids)
                    if call.extends_output and program.calls[call.parent].max_tokens:
                        shared -= 1
                cached += min(shared, lens[i] - 1)
        return cached / self.prompt_tokens


class PrefixTrie:
    """Compressed trie of token sequences (edges are token tuples)."""

    def __init__(self) -> None:
        self.root: dict[int, list] = {}  # first token -> [edge tokens, children]

    def insert(self, tokens: tuple[int, ...]) -> int:
        """Add `tokens`; return the length of its longest common prefix with any sequence
        inserted before."""
        children, pos = self.root, 0
        while pos < len(tokens):
            entry = children.get(tokens[pos])
            if entry is None:
                children[tokens[pos]] = [tokens[pos:], {}]
                return pos
            edge, kids = entry
            same = tokens[pos : pos + len(edge)] == edge
            n = len(edge) if same else _common_len(edge, tokens, pos)
            if n < len(edge):  # split the edge at the first difference
                entry[0], entry[1] = edge[:n], {edge[n]: [edge[n:], kids]}
                if pos + n < len(tokens):
                    entry[1][tokens[pos + n]] = [tokens[pos + n :], {}]
                return pos + n
            children, pos = kids, pos + n
        return pos


def _common_len(edge: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    n = 0
    while n < len(edge) and pos + n < len(tokens) and edge[n] == tokens[pos + n]:
        n += 1
    return n


class _Tokens:
    """Seeded random token ids in [FIRST_TOKEN, vocab_size)."""

    def __init__(self, name: str, seed: int, vocab_size: int) -> None:
        if vocab_size <= FIRST_TOKEN:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN}, got {vocab_size}")
        self.rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        self.vocab_size = vocab_size

    def __call__(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.integers(FIRST_TOKEN, self.vocab_size, n).tolist())

    def uniform(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return int(self.rng.integers(low, high + 1))

    def choice(self, options: tuple[int, ...]) -> int:
        return int(options[self.rng.integers(len(options))])


def shared_prefix(
    tok: _Tokens,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
) -> list[Program]:
    """SGLang's generated-shared-prefix: groups of prompts sharing a system prompt,
    independent requests in group order."""
    programs = []
    for _ in range(num_groups):
        system = tok(system_len)
        for _ in range(prompts_per_group):
            programs.append(Program((Call(None, system + tok(question_len), output_len),)))
    return programs


def multi_turn(
    tok: _Tokens,
    num_users: int,
    num_turns: int,
    system_len: int,
    input_len: tuple[int, int],
    output_lens: tuple[int, ...],
) -> list[Program]:
    """Chats: every user shares a system prompt; a turn sends the whole conversation so far
    plus `input_len` (low, high) new tokens; each answer is one of `output_lens`."""
    system = tok(system_len)
    programs = []
    for _ in range(num_users):
        calls = []
        for turn in range(num_turns):
            first = turn == 0
            new = (system if first else ()) + tok(tok.uniform(*input_len))
            calls.append(Call(None if first else turn - 1, new, tok.choice(output_lens)))
        programs.append(Program(tuple(calls)))
    return programs


def agent(
    tok: _Tokens,
    num_agents: int,
    num_steps: int,
    system_len: int,
    task_len: int,
    action_len: int,
    observation_len: tuple[int, int],
    tool_pause_s: float = 0.0,
    tool_calls: bool = False,
) -> list[Program]:
    """ReAct loops: a shared tool-description prompt, a task, then `num_steps` steps of
    thought + action (`action_len` tokens) each followed by an observation of random length,
    sent `tool_pause_s` seconds after the step finished (the tool runs meanwhile).

    `tool_calls`: the steps as OpenAI tool calls and tool results, laid out as a Hermes /
    Qwen chat template renders them (the format agent frameworks send): a step's prompt
    ends with the call's opening (`<tool_call>\n{"name": ..., "arguments": `, which a
    constrained call forces), the model generates the arguments (`action_len` tokens), and
    the next step appends the call's closing, the turn's end, the tool message around the
    observation and the next opening. The framing tokens are drawn once and shared (they
    are template text); the history is re-sent as generated (a template that re-renders a
    call's arguments as the model wrote them)."""
    system = tok(system_len)
    frame = _ToolFrame(tok) if tool_calls else None
    programs = []
    for _ in range(num_agents):
        first = system + tok(task_len) + (frame.call_open(tok) if frame else ())
        calls = [Call(None, first, action_len)]
        for step in range(1, num_steps):
            observation = tok(tok.uniform(*observation_len))
            step_input = frame.result(tok, observation) if frame else observation
            calls.append(Call(step - 1, step_input, action_len, pause_s=tool_pause_s))
        programs.append(Program(tuple(calls)))
    return programs


class _ToolFrame:
    """Template text around tool calls and results, as token ids (drawn once per workload):
    `<tool_call>\n{"name": "`, one of three tool names, `", "arguments": `; the closing
    `}\n</tool_call><|end|>\n`; `<|user|>\n<tool_response>\n` ... `\n</tool_response>
    <|end|>\n<|assistant|>\n`."""

    def __init__(self, tok: _Tokens) -> None:
        self.open, self.mid = tok(8), tok(6)
        self.names = [tok(tok.uniform(2, 4)) for _ in range(3)]
        self.close, self.result_open, self.result_close = tok(8), tok(9), tok(11)

    def call_open(self, tok: _Tokens) -> tuple[int, ...]:
        return self.open + self.names[tok.uniform(0, len(self.names) - 1)] + self.mid

    def result(self, tok: _Tokens, observation: tuple[int, ...]) -> tuple[int, ...]:
        framed = self.close + self.result_open + observation + self.result_close
        return framed + self.call_open(tok)


def tree_of_thought(
    tok: _Tokens,
    num_trees: int,
    question_len: int,
    num_levels: int,
    branches: tuple[int, int],
    prompt_len: int,
    output_len: int,
) -> list[Program]:
    """Trees of thoughts: level 0 answers the question; every node of levels < num_levels - 1
    forks `branches` (low, high) children, each with its own `prompt_len` instruction."""
    programs = []
    for _ in range(num_trees):
        calls = [Call(None, tok(question_len), output_len)]
        level = [0]
        for _ in range(1, num_levels):
            nxt = []
            for node in level:
                for _ in range(tok.uniform(*branches)):
                    nxt.append(len(calls))
                    calls.append(Call(node, tok(prompt_len), output_len))
            level = nxt
        programs.append(Program(tuple(calls)))
    return programs


def few_shot(
    tok: _Tokens,
    num_subjects: int,
    questions_per_subject: int,
    num_shots: int,
    shot_len: int,
    question_len: int,
    num_choices: int,
    choice_len: int,
    max_tokens: int,
) -> list[Program]:
    """MMLU-like select: questions of a subject share the same `num_shots` examples; a
    program prefills shots + question, then scores each choice as its own prefill-only
    call on that prefix + choice."""
    programs = []
    for _ in range(num_subjects):
        shots = sum((tok(shot_len) for _ in range(num_shots)), ())
        for _ in range(questions_per_subject):
            calls = [Call(None, shots + tok(question_len), 0)]
            calls += [
                Call(0, tok(choice_len), max_tokens, extends_output=False)
                for _ in range(num_choices)
            ]
            programs.append(Program(tuple(calls)))
    return programs


def long_history(
    tok: _Tokens,
    num_users: int,
    num_turns: int,
    history_len: tuple[int, int],
    input_len: tuple[int, int],
    output_lens: tuple[int, ...],
) -> list[Program]:
    """Chats that resume a long private history (`history_len` (low, high) tokens, e.g. a
    document or an old conversation): turn 0 sends it plus a question, each later turn the
    whole context plus `input_len` new tokens; answers are short (one of `output_lens`)."""
    programs = []
    for _ in range(num_users):
        calls = [Call(None, tok(tok.uniform(*history_len)), tok.choice(output_lens))]
        for turn in range(1, num_turns):
            calls.append(Call(turn - 1, tok(tok.uniform(*input_len)), tok.choice(output_lens)))
        programs.append(Program(tuple(calls)))
    return programs


def random_requests(
    tok: _Tokens, num_requests: int, input_len: int, output_len: int
) -> list[Program]:
    """Independent requests with unrelated prompts: nothing to reuse."""
    return [Program((Call(None, tok(input_len), output_len),)) for _ in range(num_requests)]


GENERATORS = {
    "shared-prefix": (shared_prefix, "num_groups"),
    "multi-turn": (multi_turn, "num_users"),
    "agent": (agent, "num_agents"),
    "tree-of-thought": (tree_of_thought, "num_trees"),
    "few-shot": (few_shot, "num_subjects"),
    "random": (random_requests, "num_requests"),
    "long-history": (long_history, "num_users"),
}
WORKLOADS = tuple(GENERATORS)
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w != "long-history")  # bench_serving's

SIZES: dict[str, dict[str, dict]] = {
    "shared-prefix": {  # best hit rate 15/16 * 2048/2176 = 88.2% (smoke: 15/16 * 256/272)
        "full": dict(num_groups=64, prompts_per_group=16, system_len=2048, question_len=128,
                     output_len=256),
        "smoke": dict(num_groups=4, prompts_per_group=16, system_len=256, question_len=16,
                      output_len=16),
    },
    "multi-turn": {
        "full": dict(num_users=64, num_turns=4, system_len=128, input_len=(256, 512),
                     output_lens=(8, 256)),
        "smoke": dict(num_users=16, num_turns=4, system_len=32, input_len=(32, 64),
                      output_lens=(8, 32)),
    },
    "agent": {
        "full": dict(num_agents=48, num_steps=10, system_len=512, task_len=64, action_len=48,
                     observation_len=(16, 256)),
        "smoke": dict(num_agents=6, num_steps=10, system_len=128, task_len=32, action_len=16,
                      observation_len=(8, 48)),
    },
    "tree-of-thought": {
        "full": dict(num_trees=32, question_len=512, num_levels=3, branches=(3, 4),
                     prompt_len=32, output_len=128),
        "smoke": dict(num_trees=6, question_len=64, num_levels=3, branches=(3, 4),
                      prompt_len=8, output_len=16),
    },
    "few-shot": {
        "full": dict(num_subjects=8, questions_per_subject=32, num_shots=5, shot_len=128,
                     question_len=64, num_choices=4, choice_len=16, max_tokens=0),
        "smoke": dict(num_subjects=4, questions_per_subject=16, num_shots=5, shot_len=32,
                      question_len=16, num_choices=4, choice_len=4, max_tokens=0),
    },
    "random": {
        "full": dict(num_requests=256, input_len=1024, output_len=1024),
        "smoke": dict(num_requests=32, input_len=128, output_len=32),
    },
    "long-history": {
        "full": dict(num_users=48, num_turns=4, history_len=(4096, 16384), input_len=(32, 128),
                     output_lens=(16, 32)),
        "smoke": dict(num_users=8, num_turns=3, history_len=(128, 384), input_len=(8, 16),
                      output_lens=(4, 8)),
    },
}  # fmt: skip


def make_workload(
    name: str,
    size: str = "full",
    scale: float = 1.0,
    seed: int = 0,
    vocab_size: int = 32000,
    **overrides: object,
) -> Workload:
    """Generate workload `name` at `size` (full | smoke), its count key times `scale`
    (at least 1); `overrides` replace generator arguments. Same arguments, same workload."""
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}")
    if size not in SIZES[name]:
        raise ValueError(f"unknown size {size!r}; allowed: {', '.join(SIZES[name])}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    generate, count_key = GENERATORS[name]
    params = {**SIZES[name][size], **overrides}
    params[count_key] = max(1, round(params[count_key] * scale))
    programs = generate(_Tokens(name, seed, vocab_size), **params)
    return Workload(name, tuple(programs), {**params, "seed": seed, "vocab_size": vocab_size})


def interleave(first: Workload, second: Workload) -> tuple[Workload, list[bool]]:
    """One workload of both's programs, `second`'s spread evenly among `first`'s (programs
    arrive in index order), and per program whether it came from `first`."""
    n, m = len(first.programs), len(second.programs)
    order = sorted([(i / n, 0, i) for i in range(n)] + [((j + 0.5) / m, 1, j) for j in range(m)])
    sources = (first.programs, second.programs)
    programs = tuple(sources[src][i] for _, src, i in order)
    params = {first.name: first.params, second.name: second.params}
    mixed = Workload(f"{first.name}+{second.name}", programs, params)
    return mixed, [src == 0 for _, src, _ in order]
