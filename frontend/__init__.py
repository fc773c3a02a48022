"""radixrt.frontend: a small DSL for multi-call LLM programs that share prefixes.

    from radixrt.frontend import function, gen, select, user, assistant, Runtime

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    backend = Runtime("path/to/model")            # or RuntimeEndpoint("http://host:port")
    state = qa.run(question="Why is the sky blue?", backend=backend)
    print(state["answer"])

Primitives: `s += "text"`, `gen(name, ...)`, `select(name, choices)`, roles
(`system/user/assistant(...)` or `with s.user(): ...`), `s.fork(n)` / `.join()`,
`program.run(...)`, `program.run_batch([...])`, `run(..., stream=True).text_iter()`.
"""

if __name__ != "radixrt.frontend":  # found by its bare name: radixrt/_top_level.py
    from radixrt._top_level import defer_to_installed

    defer_to_installed(__name__, __file__)
else:
    from .backends import Backend, EngineBackend, GenResult, Runtime, RuntimeEndpoint
    from .errors import BackendError, UnknownVariableError
    from .ir import assistant, gen, role, select, system, tool_result, tools, user
    from .program import Program, function, get_default_backend, set_default_backend
    from .state import ForkGroup, ProgramState, StreamingState

    __all__ = [
        "Backend",
        "BackendError",
        "EngineBackend",
        "ForkGroup",
        "GenResult",
        "Program",
        "ProgramState",
        "Runtime",
        "RuntimeEndpoint",
        "StreamingState",
        "UnknownVariableError",
        "assistant",
        "function",
        "gen",
        "get_default_backend",
        "role",
        "select",
        "set_default_backend",
        "system",
        "tool_result",
        "tools",
        "user",
    ]
