"""Frontend DSL on the in-process backend over the tiny model: every primitive, select
against directly computed log-probs, fork cache reuse, run_batch vs sequential runs,
streaming, roles vs the chat template, and clear errors."""

from __future__ import annotations

import threading
import time

import pytest
from engine_utils import wait_no_holds

from radixrt import SamplingParams
from radixrt.frontend import (
    BackendError,
    EngineBackend,
    UnknownVariableError,
    assistant,
    function,
    gen,
    role,
    select,
    set_default_backend,
    system,
    tool_result,
    tools,
    user,
)
from radixrt.frontend.chat import ChatTemplate
from radixrt.frontend.ir import to_ops
from radixrt.sampling import DEFAULT_OPTIONS

GREEDY = {"temperature": 0, "max_tokens": 8}
SHARED = "You are a careful assistant. Think about the question, then answer it briefly. " * 3

ROLES_2_TURNS = ["system", "user", "assistant", "user", "assistant"]


@pytest.fixture
def backend(make_engine):
    b = EngineBackend(make_engine())
    yield b
    b.close()  # before make_engine's teardown checks that no request holds KV


class Spy:
    """Wraps a backend, recording calls (and optionally delaying generate at a barrier)."""

    releases_holds = False  # programs through it hold nothing
    holds_back_shared_prefixes = False  # a fork waits for its prefix hint

    def __init__(self, inner, barrier: threading.Barrier | None = None) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.chat_template = inner.chat_template
        self.barrier = barrier
        self.calls: list[tuple] = []
        self.params: list[SamplingParams] = []  # of the gens (max_tokens > 0)

    def encode(self, text):
        return self.inner.encode(text)

    def encode_continuation(self, text):
        return self.inner.encode_continuation(text)

    def generate(self, ids, params, on_delta=None, options=DEFAULT_OPTIONS):
        self.calls.append(("generate", list(ids), params.max_tokens))
        if params.max_tokens > 0:
            self.params.append(params)
        if self.barrier is not None and params.max_tokens > 0:
            self.barrier.wait(timeout=30)  # fails unless the branches run concurrently
        return self.inner.generate(ids, params, on_delta, options=options)

    def cache_prefix(self, ids, cache_salt=None, cache_ttl_s=0.0):
        self.calls.append(("cache_prefix", list(ids)))
        return self.inner.cache_prefix(ids, cache_salt, cache_ttl_s)

    def score_continuations(self, prefix, conts, cache_salt=None):
        self.calls.append(("score", list(prefix), [list(c) for c in conts]))
        return self.inner.score_continuations(prefix, conts)


def test_text_and_gen_match_engine_generate(backend):
    @function
    def prog(s, topic):
        s += f"Write about {topic}:"
        s += gen("a", max_tokens=10, temperature=0, ignore_eos=True)
        s += "\nMore:" + gen("b", max_tokens=5, temperature=0)

    state = prog.run(topic="rivers", backend=backend)
    engine = backend.engine
    backend.close()  # the test drives the engine directly below
    ids = engine.tokenizer.encode("Write about rivers:")
    ref = engine.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(10, 0.0, ignore_eos=True)
    )[0]
    assert state["a"] == ref.text and state.meta("a")["output_ids"] == ref.token_ids
    meta = state.meta("a")
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 10
    assert meta["finish_reason"] == "length"
    assert state.text() == f"Write about rivers:{state['a']}\nMore:{state['b']}"
    assert set(state.variables()) == {"a", "b"}


def test_gen_options_reach_sampling_params(backend):
    spy = Spy(backend)

    @function
    def prog(s):
        s += "Numbers and letters:"
        s += gen("a", 5, ["zz"], 0.7, 0.9, 50, 0.01, 7, True, [9])
        s += gen("b")

    prog.run(backend=spy, gen_defaults={"temperature": 0, "max_tokens": 3})
    assert spy.params == [
        SamplingParams(
            max_tokens=5,
            stop=("zz",),
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            min_p=0.01,
            seed=7,
            ignore_eos=True,
            stop_token_ids=(9,),
        ),
        SamplingParams(max_tokens=3, temperature=0),  # unset options: gen_defaults
    ]
    with pytest.raises(ValueError, match="temperature"):
        gen("x", temperature=-1)
    with pytest.raises(ValueError, match="unknown gen_defaults"):
        prog.run(backend=backend, gen_defaults={"max_new_tokens": 3})


def test_gen_stop_string(backend):
    @function
    def prog(s, stop):
        s += "Numbers and letters:"
        s += gen("x", max_tokens=12, temperature=0, ignore_eos=True, stop=stop)

    full = prog.run(stop=None, backend=backend)
    assert full.meta("x")["completion_tokens"] == 12
    assert full.meta("x")["finish_reason"] == "length"
    ch = full["x"].strip()[0]  # a character the greedy continuation contains
    cut = prog.run(stop=[ch], backend=backend)
    assert ch not in cut["x"] and full["x"].startswith(cut["x"])
    assert cut.meta("x")["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(backend):
    @function
    def prog(s):
        s += "Once upon a time"
        s += gen("x", max_tokens=8, temperature=1.0, seed=123)

    assert prog.run(backend=backend)["x"] == prog.run(backend=backend)["x"]


def reference_choice_logprobs(engine, prefix_ids, choice_ids):
    """log p of each choice token, computed from the full sequence with one request."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=True)
    out = engine.generate(prompt_token_ids=[prefix_ids + choice_ids], sampling_params=params)
    return out[0].prompt_logprobs[len(prefix_ids) - 1 :]  # prompt_logprobs start at index 1


@pytest.mark.parametrize("normalize", [True, False])
def test_select_is_argmax_of_full_sequence_logprobs(make_engine, normalize):
    choices = ["Paris", " Paris", "London town", "a very long answer indeed", "7"]
    prefix = "Question: what is the capital of France? Answer:"
    backend = EngineBackend(make_engine())
    spy = Spy(backend)

    @function
    def prog(s):
        s += prefix
        s += select("city", choices=choices, normalize=normalize)

    state = prog.run(backend=spy)
    backend.close()
    ref_engine = make_engine(prefix_cache="none")
    tok = ref_engine.tokenizer
    prefix_ids = tok.encode(prefix)
    ref = []
    for c in choices:
        lps = reference_choice_logprobs(
            ref_engine, prefix_ids, tok.encode(c, add_special_tokens=False)
        )
        ref.append(sum(lps) / len(lps) if normalize else sum(lps))
    best = max(range(len(ref)), key=ref.__getitem__)
    meta = state.meta("city")
    assert state["city"] == choices[best] and meta["index"] == best
    assert meta["scores"] == pytest.approx(ref, abs=1e-4)
    assert state.text() == prefix + choices[best]
    # one prefix prefill, then every choice in ONE batched scoring call
    assert [c[0] for c in spy.calls] == ["cache_prefix", "score"]
    assert spy.calls[0][1] == prefix_ids and len(spy.calls[1][2]) == len(choices)


def test_select_reuses_the_cached_prefix(backend):
    @function
    def prog(s):
        s += SHARED + "Is the sky blue? Answer:"
        s += select("yn", choices=[" yes", " no", " maybe"])

    before = backend.engine.stats()
    prog.run(backend=backend)
    after = backend.engine.stats()
    n_prefix = len(backend.encode(SHARED + "Is the sky blue? Answer:"))
    # all 3 choice requests reuse the prefix (the prefix request itself computes it)
    assert after["cached_tokens"] - before["cached_tokens"] >= 3 * (n_prefix - 1)


class FixedScores(Spy):
    """A backend whose continuation log-probs are given (to test select's arithmetic)."""

    def __init__(self, inner, token_logprobs):
        super().__init__(inner)
        self.token_logprobs = token_logprobs

    def score_continuations(self, prefix, conts, cache_salt=None):
        return self.token_logprobs


def test_select_normalization_and_ties(backend):
    @function
    def prog(s, normalize):
        s += "Pick:"
        s += select("x", choices=["a", "b", "c"], normalize=normalize)

    # sums -3, -2, -2 (tie: first wins); means -1.5, -2, -1 (c wins)
    scores = FixedScores(backend, [[-1.0, -2.0], [-2.0], [-1.0, -1.0]])
    assert prog.run(normalize=False, backend=scores)["x"] == "b"
    state = prog.run(normalize=True, backend=scores)
    assert state["x"] == "c"
    assert state.meta("x")["scores"] == [-1.5, -2.0, -1.0]
    assert state.meta("x")["logprob_sums"] == [-3.0, -2.0, -2.0]
    tie = FixedScores(backend, [[-1.0], [-1.0], [-1.0]])
    assert prog.run(normalize=True, backend=tie)["x"] == "a"
    with pytest.raises(ValueError, match="non-empty"):
        select("x", choices=[])
    with pytest.raises(ValueError, match="non-empty strings"):
        select("x", choices=["a", ""])


def test_roles_render_like_apply_chat_template(backend):
    @function
    def chat(s, question):
        s += system("Be brief.")
        s += user(question)
        s += assistant(gen("a1", max_tokens=6))
        with s.user():
            s += "Thanks! And "
            s += "why?"
        with s.assistant():
            s += "Because " + gen("a2", max_tokens=6)

    state = chat.run(question="What is 2+2?", backend=backend, gen_defaults=GREEDY)
    tok = backend.tokenizer
    messages = state.messages()
    assert [m["role"] for m in messages] == ROLES_2_TURNS
    assert messages[3]["content"] == "Thanks! And why?"
    assert messages[4]["content"] == "Because " + state["a2"]
    assert state.text() == tok.apply_chat_template(messages, tokenize=False)
    # the first assistant gen ran right after the generation prompt
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert state.meta("a1")["prompt_tokens"] == len(tok.encode(prompt))
    assert state.text().startswith(prompt + state["a1"])


def test_chat_template_with_bos_and_default_system_prompt(tiny_model_dir):
    """Prefixes/suffixes come from rendering, so templates unlike the tiny one work too."""
    from radixrt.hf_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (
        "{{ bos_token }}{% if messages[0]['role'] != 'system' %}[SYS]default[/SYS]{% endif %}"
        "{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}[/END]\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    chat = ChatTemplate(tok)
    messages, text = [], ""
    for name, content in [("user", "hi"), ("assistant", "hello"), ("user", "bye")]:
        text += chat.prefix(messages, name) + content + chat.suffix(messages, name)
        messages.append({"role": name, "content": content})
        assert text == tok.apply_chat_template(messages, tokenize=False)
    assert chat.prefix(messages, "assistant") == "[ASSISTANT]"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        chat.prefix([], "user")


def test_role_errors(backend):
    @function
    def nested_block(s):
        with s.user():
            s += assistant("x")

    with pytest.raises(ValueError, match="roles do not nest"):
        nested_block.run(backend=backend)
    with pytest.raises(ValueError, match="roles do not nest"):
        to_ops(user(system("x")))
    with pytest.raises(ValueError, match="unknown role"):
        role("function", "x")


@function
def branch_alone(s, i):
    s += SHARED + f"Idea {i}:" + gen("idea", max_tokens=6)


def test_fork_runs_branches_concurrently_and_hits_the_cache(backend):
    spy = Spy(backend, barrier=threading.Barrier(3))

    @function
    def prog(s):
        s += SHARED
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i}:" + gen("idea", max_tokens=6)
        forks.join()
        s += "Best idea:" + forks[0]["idea"]
        kept.append(forks)

    kept = []
    state = prog.run(backend=spy, gen_defaults=GREEDY)
    forks = kept[0]
    n_shared = len(backend.encode(SHARED))
    assert spy.calls[0] == ("cache_prefix", backend.encode(SHARED))  # the prefix hint
    for i, f in enumerate(forks):
        meta = f.meta("idea")
        assert meta["cached_tokens"] >= n_shared - 1
        assert f.text() == SHARED + f"Idea {i}:" + f["idea"]
        # each branch equals a sequential greedy run of its own text
        solo = function(
            lambda s, i=i: s.__iadd__(SHARED + f"Idea {i}:" + gen("idea", max_tokens=6))
        )
        assert solo.run(backend=backend, gen_defaults=GREEDY)["idea"] == f["idea"]
    assert forks["idea"] == [f["idea"] for f in forks]
    assert state.text() == SHARED + "Best idea:" + forks[0]["idea"]
    assert "idea" not in state.variables()  # branches do not write into the parent


def test_forks_join_implicitly_and_report_errors(backend):
    @function
    def unjoined(s):
        s += "Start:"
        for f in s.fork(2):
            f += gen("x", max_tokens=4)

    unjoined.run(backend=backend, gen_defaults=GREEDY)  # joined at program end: no KV leak

    @function
    def failing(s):
        s += "Start:"
        forks = s.fork(2)
        with forks[1].user():
            forks[1] += user("nested")  # fails in the branch's worker thread
        forks[0] += gen("x", max_tokens=4)

    with pytest.raises(ValueError, match="roles do not nest"):
        failing.run(backend=backend, gen_defaults=GREEDY)

    @function
    def recovering(s):
        s += "Start:"
        forks = s.fork(2)
        forks[0] += gen("x", max_tokens=4)
        try:
            with forks[1].user():
                forks[1] += user("nested")
            forks.join()
        except ValueError:  # a fork error the program handles is not raised again
            s += " recovered"

    assert recovering.run(backend=backend).text() == "Start: recovered"

    @function
    def read_unknown(s):
        s += "Start:"
        forks = s.fork(2)
        forks[0] += gen("x", max_tokens=2)
        forks[0]["y"]

    with pytest.raises(UnknownVariableError, match="'y'; known variables: 'x'"):
        read_unknown.run(backend=backend, gen_defaults=GREEDY)


def few_shot(s, question):
    s += "Answer each question.\n" + "Q: What is 1+1?\nA: 2\n" * 4
    s += f"Q: {question}\nA:" + gen("answer", max_tokens=6, stop="\n")
    s += " Sure?" + select("sure", choices=[" yes", " no"])


def test_run_batch_equals_sequential_runs(backend):
    prog = function(few_shot)
    questions = [f"What is {i}+{i}?" for i in range(6)]
    spy = Spy(backend)
    states = prog.run_batch(
        [{"question": q} for q in questions],
        backend=spy,
        num_threads=3,
        progress_bar=True,
        gen_defaults=GREEDY,
    )
    common = spy.calls[0]
    assert common[0] == "cache_prefix"  # the batch's common prefix, sent once first
    assert backend.tokenizer.decode(common[1]).startswith("Answer each question.")
    for q, state in zip(questions, states):
        alone = prog.run(question=q, backend=backend, gen_defaults=GREEDY)
        assert state.variables() == alone.variables()
        assert state.text() == alone.text()
    assert prog.run_batch([], backend=backend) == []
    with pytest.raises(ValueError, match="keyword-argument dicts"):
        prog.run_batch(["x"], backend=backend)


def test_run_batch_raises_the_first_failure_after_all_finish(backend):
    @function
    def prog(s, name):
        s += "Hello" + gen("x", max_tokens=3)
        s[name]

    with pytest.raises(UnknownVariableError, match="'nope'"):
        prog.run_batch([{"name": "x"}, {"name": "nope"}, {"name": "x"}], backend=backend)


def test_streaming_text_iter(backend):
    @function
    def prog(s):
        s += "Tell me a story:"
        s += gen("story", max_tokens=10, ignore_eos=True)
        s += "\nMoral:" + gen("moral", max_tokens=4)

    stream = prog.run(backend=backend, stream=True, gen_defaults=GREEDY)
    chunks = list(stream.text_iter())
    assert len(chunks) > 5  # token by token, not one piece
    assert "".join(chunks) == stream.text()
    assert stream.text() == prog.run(backend=backend, gen_defaults=GREEDY).text()
    only = prog.run(backend=backend, stream=True, gen_defaults=GREEDY)
    assert "".join(only.text_iter("story")) == only["story"]

    @function
    def failing(s):
        s += "x" + gen("a", max_tokens=2)
        s["missing"]

    bad = failing.run(backend=backend, stream=True)
    with pytest.raises(UnknownVariableError):
        list(bad.text_iter())


def test_unknown_variable_and_usage_errors(backend):
    @function
    def prog(s):
        s += "Hi" + gen("greeting", max_tokens=2)
        s += select("mood", choices=["happy", "sad"])
        s["gretting"]

    with pytest.raises(UnknownVariableError) as err:
        prog.run(backend=backend)
    assert str(err.value) == "unknown variable 'gretting'; known variables: 'greeting', 'mood'"
    assert isinstance(err.value, KeyError)

    @function
    def empty(s):
        s += gen("x")

    with pytest.raises(ValueError, match="prompt is empty"):
        empty.run(backend=backend)
    set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        empty.run()

    @function
    def bad_operand(s):
        s += 3

    with pytest.raises(ValueError, match="cannot add int"):
        bad_operand.run(backend=backend)

    @function
    def ok(s):
        s += "Hi" + gen("x", max_tokens=2)

    state = ok.run(backend=backend)
    with pytest.raises(RuntimeError, match="finished"):
        state += "more"


def test_default_backend_and_composition(backend):
    @function
    def inner(s, word):
        s += f" {word}:" + gen(word, max_tokens=3)

    @function
    def outer(s):
        s += "Words"
        inner(s, "one")
        inner(s, "two")

    set_default_backend(backend)
    try:
        state = outer.run(gen_defaults=GREEDY)
    finally:
        set_default_backend(None)
    assert set(state.variables()) == {"one", "two"}


def test_closed_backend_raises(backend):
    backend.close()

    @function
    def prog(s):
        s += "Hi" + gen("x", max_tokens=2)

    with pytest.raises(BackendError, match="closed"):
        prog.run(backend=backend)


def test_a_programs_retention_holds_end_with_it(backend):
    from radixrt.frontend import function

    retention = backend.engine.core.scheduler.retention
    seen: list[int] = []

    @function
    def prog(s):
        s += "An agent step:" + gen("a", max_tokens=3, temperature=0)
        s += " tool output." + gen("b", max_tokens=3, temperature=0)
        seen.append(retention.num_held_blocks)  # read while the program runs

    prog.run(backend=backend, gen_defaults={"cache_ttl_s": 60})
    assert seen[0] > 0
    wait_no_holds(retention)


def test_tools_render_like_apply_chat_template_and_calls_are_read_back(backend):
    """Offered tools and tool messages render as the chat template renders them; a gen
    with a required tool choice returns a call whose arguments match the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    defs = [{"type": "function", "function": {"name": "weather", "parameters": schema}}]

    @function
    def agent(s):
        s += tools(defs)
        s += user("Weather in Oslo?")
        s += assistant(gen("step", max_tokens=120, tool_choice="weather", temperature=0.0))
        for call in s.tool_calls("step"):
            s += tool_result(call["id"], "rain")

    state = agent.run(backend=backend)
    (call,) = state.tool_calls("step")
    assert call["name"] == "weather" and set(call["arguments"]) == {"city"}
    assert call["id"].startswith("call_") and state["step"] == ""
    tok = backend.chat_template.tokenizer
    messages = state.messages()
    assert messages[-1] == {"role": "tool", "content": "rain", "tool_call_id": call["id"]}
    assert state.text() == tok.apply_chat_template(messages, tools=list(defs), tokenize=False)


def test_tool_errors(backend):
    with pytest.raises(ValueError, match="parameters"):
        tools([{"name": "f", "parameters": {"type": "array"}}])

    @function
    def late(s):
        s += user("x")
        s += tools([{"name": "f"}])

    with pytest.raises(ValueError, match="before the first role"):
        late.run(backend=backend)

    @function
    def unknown(s):
        s += tools([{"name": "f"}])
        s += user("x") + assistant(gen("a", max_tokens=2, tool_choice="g"))

    with pytest.raises(ValueError, match="tool_choice 'g'"):
        unknown.run(backend=backend)


def test_run_on_engine_comes_after_the_releases_queued_before_it(backend):
    """`run_on_engine` runs on the engine thread in queue order: a hold released just before
    is gone when it runs (no polling), and its function's result or error comes back."""
    retention = backend.engine.core.scheduler.retention
    sent = backend.cache_prefix(backend.encode(SHARED), None, 60.0)
    assert backend.run_on_engine(lambda e: list(e.core.scheduler.retention.holds)) == [sent.rid]
    backend.release_cache_holds([sent.rid])
    assert backend.run_on_engine(lambda e: len(e.core.scheduler.retention.holds)) == 0
    assert not retention.holds
    with pytest.raises(ZeroDivisionError):
        backend.run_on_engine(lambda e: 1 / 0)
    backend.close()
    with pytest.raises(BackendError):
        backend.run_on_engine(lambda e: None)


@pytest.mark.parametrize("how", ["ends", "raises", "fork-raises", "closed"])
def test_a_program_holds_its_context_by_default_and_never_leaks_it(make_engine, how):
    """Without any hint a program holds its context between its calls (in-process backend:
    gens, fork prefixes) and the holds end with it: at its end, when its body or a fork
    raises, or when the backend closes under it; greedy outputs equal a run without holds."""
    from radixrt.frontend import function

    engine = make_engine()
    retention = engine.core.scheduler.retention
    seen: list[int] = []

    @function
    def prog(s, fail: str):
        s += "An agent step:" + gen("a", max_tokens=3, temperature=0)
        seen.append(retention.num_held_blocks)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" branch {i}:" + gen("b", max_tokens=3, temperature=0)
            if fail == "fork-raises" and i == 1:  # longer than the model's context: refused
                f += " word" * 2100 + gen("c", max_tokens=3, temperature=0)
        forks.join()
        s += " tool output." + gen("d", max_tokens=3, temperature=0)
        if fail == "raises":
            raise RuntimeError("the program failed")

    backend = EngineBackend(engine)
    try:
        if how == "ends":
            state = prog.run(backend=backend, fail="")
            plain = prog.run(backend=backend, fail="", gen_defaults={"cache_ttl_s": 0})
            assert state.text() == plain.text()
        elif how == "closed":
            run = prog.run(backend=backend, fail="", stream=True)
            while not seen:
                time.sleep(0.001)
            backend.close()
            with pytest.raises(BackendError):
                run.wait(30)
        else:
            with pytest.raises((RuntimeError, ValueError)):
                prog.run(backend=backend, fail=how)
        assert seen and seen[0] > 0  # held while it ran
        if how != "closed":
            wait_no_holds(retention)
    finally:
        backend.close()
    if how == "closed":  # the engine thread is gone: nothing released the holds, they expire
        retention.clock = lambda: time.monotonic() + 3600
        engine.core.step()
        assert not retention.holds
    engine.check_integrity()
