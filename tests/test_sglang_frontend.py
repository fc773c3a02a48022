"""SGLang's frontend language, unchanged, against `radixrt serve`: gen (plain, regex,
streamed), select, fork, roles and run_batch through `sgl.RuntimeEndpoint`.

SGLang is installed with `pip install --no-deps sglang==0.5.23`; its top-level `__init__`
imports the server stack (psutil, torch, ...), so `sglang_lang()` registers a bare `sglang`
package whose `__path__` is the installed one and imports `sglang.lang` submodules
directly. `sglang.utils` (imported by `sglang.lang`) also imports `pybase64` and
`IPython.display`, which nothing here uses: the standard `base64` module and a no-op
`IPython.display` stand in when they are not installed. Skipped when sglang is absent.
"""

from __future__ import annotations

import base64
import importlib.util
import re
import sys
import types

import pytest
from server_utils import serving

SGLANG_VERSION = "0.5.23"


def sglang_lang() -> types.SimpleNamespace:
    """sglang.lang's API without sglang's top-level __init__."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = pkg
    if importlib.util.find_spec("pybase64") is None:
        sys.modules.setdefault("pybase64", base64)
    if importlib.util.find_spec("IPython") is None:
        display = types.ModuleType("IPython.display")
        display.HTML = display.display = lambda *args, **kwargs: None
        ipython = types.ModuleType("IPython")
        ipython.display = display
        sys.modules.setdefault("IPython", ipython)
        sys.modules.setdefault("IPython.display", display)
    from importlib.metadata import version

    from sglang.lang import api
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    assert version("sglang") == SGLANG_VERSION, version("sglang")
    return types.SimpleNamespace(
        function=api.function,
        gen=api.gen,
        select=api.select,
        system=api.system,
        user=api.user,
        assistant=api.assistant,
        RuntimeEndpoint=RuntimeEndpoint,
    )


@pytest.fixture(scope="module")
def sgl():
    return sglang_lang()


@pytest.fixture(scope="module")
def backend(sgl, tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield sgl.RuntimeEndpoint(srv.url)


def test_gen_select_fork_roles_batch(sgl, backend):
    @sgl.function
    def program(s, topic):
        s += "Write about " + topic + ".\n"
        s += "Text: " + sgl.gen("text", max_tokens=12, temperature=0)
        s += "\nNumber: " + sgl.gen("number", max_tokens=6, regex=r"[0-9]{1,3}", temperature=0)
        s += "\nAnswer: " + sgl.select("answer", choices=["yes", "no", "maybe"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}: " + sgl.gen("idea", max_tokens=5, temperature=0)
        s += "\nIdeas: " + forks[0]["idea"] + " / " + forks[1]["idea"]

    state = program.run(topic="boats", backend=backend)
    assert isinstance(state["text"], str) and state["text"]
    assert re.fullmatch(r"[0-9]{1,3}", state["number"]), state["number"]
    assert state["answer"] in ("yes", "no", "maybe")
    assert "Ideas: " in state.text()
    # greedy: the same program gives the same text again
    again = program.run(topic="boats", backend=backend)
    assert again.text() == state.text()

    states = program.run_batch([{"topic": "cats"}, {"topic": "boats"}], backend=backend)
    assert states[1].text() == state.text()
    assert states[0]["answer"] in ("yes", "no", "maybe")


def test_streaming_matches_non_streaming(sgl, backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=96, temperature=0, ignore_eos=True)

    full = story.run(backend=backend)["rest"]
    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter("rest"))
    # the front merges what a slow reader has not taken yet: enough tokens that a loaded
    # machine still sees more than one piece
    assert "".join(pieces) == full and len(pieces) > 1


def test_roles(sgl, backend):
    @sgl.function
    def chat(s):
        s += sgl.system("You are brief.")
        s += sgl.user("Say something.")
        s += sgl.assistant(sgl.gen("reply", max_tokens=8, temperature=0))
        s += sgl.user("Again.")
        s += sgl.assistant(sgl.gen("again", max_tokens=8, temperature=0))

    state = chat.run(backend=backend)
    assert isinstance(state["reply"], str) and isinstance(state["again"], str)
    assert len(state.messages()) == 5
