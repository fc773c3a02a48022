"""The frontend examples run end to end on the tiny model (in-process, small settings)."""

from __future__ import annotations

import pytest

from radixrt.frontend.examples import chat, few_shot_select, react_agent, tree_of_thought
from radixrt.frontend.examples.react_agent import calculator, lookup

COMMON = ["--device", "cpu", "--max-tokens", "4"]

ROLES_2_TURNS = ["system", "user", "assistant", "user", "assistant"]


def test_chat_example(tiny_model_dir, capsys):
    state = chat.main(["--model", tiny_model_dir, *COMMON, "--turns", "2"])
    assert [m["role"] for m in state.messages()] == ROLES_2_TURNS
    assert state.meta("answer_1")["cached_tokens"] > state.meta("answer_0")["prompt_tokens"] // 2
    assert "prefix cache" in capsys.readouterr().out


def test_react_agent_example(tiny_model_dir):
    state = react_agent.main(["--model", tiny_model_dir, *COMMON, "--steps", "2"])
    actions = [v for k, v in state.variables().items() if k.startswith("action_")]
    assert 1 <= len(actions) <= 2 and set(actions) <= set(react_agent.ACTIONS)
    assert "answer" in state.variables()


@pytest.mark.parametrize("max_tokens", ["4", "120"])
def test_react_agent_with_tool_calls(tiny_model_dir, max_tokens):
    args = ["--model", tiny_model_dir, "--device", "cpu", "--max-tokens", max_tokens]
    state = react_agent.main([*args, "--steps", "2", "--protocol", "tools"])
    roles = [m["role"] for m in state.messages()]
    assert roles[:3] == ["system", "user", "assistant"] and roles[-1] == "assistant"
    if max_tokens == "4":  # a cut call has no name yet: no call, the agent answers
        assert state.tool_calls("step_0") == [] and "tool" not in roles
        return
    calls = state.tool_calls("step_0")  # required: the first step calls a tool
    assert calls and all(c["name"] in react_agent.TOOLS for c in calls)
    assert all(isinstance(c["arguments"], dict) and len(c["arguments"]) == 1 for c in calls)
    results = [m for m in state.messages() if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results[: len(calls)]] == [c["id"] for c in calls]
    assert "<tool_response>" in state.text()


def test_react_agent_tools():
    assert calculator("3 * (4 + 5)") == "27"
    assert calculator("2 ** 100").startswith("error:")  # ** is not offered
    assert calculator("__import__('os')").startswith("error:")
    assert "8849" in lookup("How high is Everest?")
    assert lookup("unknown thing").startswith("no entry")


def test_tree_of_thought_example(tiny_model_dir):
    args = ["--model", tiny_model_dir, *COMMON, "--branches", "2", "--depth", "2"]
    state = tree_of_thought.main(args)
    content = state.messages()[-1]["content"]
    assert content.count("Step ") == 2 and "Answer:" in content


def test_few_shot_select_example(tiny_model_dir, capsys):
    states = few_shot_select.main(["--model", tiny_model_dir, *COMMON, "--num-questions", "3"])
    assert all(s["answer"] in (" A", " B", " C", " D") for s in states)
    assert "accuracy" in capsys.readouterr().out
