"""A ReAct-style agent: think, pick a tool, call it, observe; bounded steps.

`--protocol text` spells steps out (Thought / Action picked with select / Input);
`--protocol tools` offers the tools to the chat template and lets the model call them
(the first step must call one; calls are valid by construction), answering each call
with a tool message. The tools are fakes (a safe calculator and a lookup table), so the
loop runs offline.

    python -m radixrt.frontend.examples.react_agent [--model DIR | --url URL] [--steps N]
        [--protocol text|tools]
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence

from radixrt.frontend import (
    ProgramState,
    assistant,
    function,
    gen,
    select,
    system,
    tool_result,
    tools,
    user,
)

from .common import cache_report, make_backend, parse_args

FACTS = {
    "paris": "Paris is the capital of France; about 2.1 million people live there.",
    "everest": "Mount Everest is 8849 metres high.",
    "python": "Python is a programming language created by Guido van Rossum in 1991.",
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate + - * / % on numbers; anything else is reported as an observation."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:  # told to the model
        return f"error: {type(e).__name__}: {e}"


def lookup(query: str) -> str:
    words = query.lower().split()
    hits = [fact for key, fact in FACTS.items() if key in words or key in query.lower()]
    return " ".join(hits) or f"no entry for {query.strip()!r}; known: {', '.join(FACTS)}"


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "lookup": lookup}
ACTIONS = [*TOOLS, "finish"]

INSTRUCTIONS = (
    "Answer the question. Work in steps of the form\n"
    "Thought: <reasoning>\nAction: <one of calculator, lookup, finish>\n"
    "Input: <the tool input>\n"
    "Tools: calculator evaluates arithmetic like 3 * (4 + 5); lookup finds facts about "
    f"{', '.join(FACTS)}. Choose finish when you know the answer."
)


@function
def react_agent(s, question: str, max_steps: int, max_tokens: int) -> None:
    s += system(INSTRUCTIONS)
    s += user(question)
    for step in range(max_steps):
        s += assistant(
            "Thought: "
            + gen(f"thought_{step}", max_tokens=max_tokens, stop="\n")
            + "\nAction: "
            + select(f"action_{step}", choices=ACTIONS)
            + "\nInput: "
            + gen(f"input_{step}", max_tokens=max_tokens, stop="\n")
        )
        action = s[f"action_{step}"]
        if action == "finish":
            break
        s += user(f"Observation: {TOOLS[action](s[f'input_{step}'])}")
    s += assistant("Final answer: " + gen("answer", max_tokens=max_tokens, stop="\n"))


def _tool(name: str, description: str, arg: str) -> dict:
    schema = {
        "type": "object",
        "properties": {arg: {"type": "string", "maxLength": 60}},
        "required": [arg],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": schema}}  # fmt: skip


TOOL_DEFS = [
    _tool("calculator", "evaluate arithmetic like 3 * (4 + 5)", "expression"),
    _tool("lookup", f"find facts about {', '.join(FACTS)}", "query"),
]


def run_call(call: dict) -> str:
    """A call's observation (a bad call is reported to the model, not raised)."""
    args = call["arguments"]
    if call["name"] not in TOOLS or not isinstance(args, dict) or len(args) != 1:
        return f"error: bad call {call['name']}({args!r})"
    return TOOLS[call["name"]](str(next(iter(args.values()))))


@function
def tool_agent(s, question: str, max_steps: int, max_tokens: int) -> None:
    s += tools(TOOL_DEFS)
    s += system("Answer the question; call a tool when you need a fact or arithmetic.")
    s += user(question)
    for step in range(max_steps):
        choice = "required" if step == 0 else "auto"
        step_gen = gen(
            f"step_{step}", max_tokens=max_tokens, tool_choice=choice, parallel_tool_calls=False
        )
        s += assistant(step_gen)
        calls = s.tool_calls(f"step_{step}")
        if not calls:
            break
        for call in calls:
            s += tool_result(call["id"], run_call(call))
    s += assistant("Final answer: " + gen("answer", max_tokens=max_tokens, stop="\n"))


def main(argv: Sequence[str] | None = None) -> ProgramState:
    def options(p):
        p.add_argument("--steps", type=int, default=3, help="max thought/action steps")
        p.add_argument("--question", default="How high is Mount Everest in kilometres?")
        p.add_argument("--protocol", choices=["text", "tools"], default="text",
                       help="steps as text (select picks the action) or as tool calls")  # fmt: skip

    args = parse_args(__doc__, argv, options)
    with make_backend(args) as backend:
        program = tool_agent if args.protocol == "tools" else react_agent
        state = program.run(
            question=args.question,
            max_steps=args.steps,
            max_tokens=args.max_tokens,
            backend=backend,
            gen_defaults={"temperature": args.temperature},
        )
        for message in state.messages()[1:]:
            print(f"[{message['role']}] {message['content']!r}")
        print(cache_report(backend))
    return state


if __name__ == "__main__":
    main()
