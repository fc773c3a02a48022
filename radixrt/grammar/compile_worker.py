"""Grammar compile workers: a template process that forks them (the parent's side is
`radixrt.grammar.compile_pool`).

The parent starts `python -c BOOT <fd>` with one end of a socket pair and sends a
`WorkerSetup`; this template process loads the tokenizer and builds xgrammar's TokenizerInfo
once (seconds: xgrammar imports torch) and answers `TemplateReady` (the TokenizerInfo as xgrammar's
JSON, which the parent needs to deserialize compiled grammars, and the control-byte mask of
JSON schemas). Then each `FORK` it receives forks a worker (milliseconds, memory shared
copy-on-write) and answers the worker's pid, passing the parent its end of a new socket pair
(SCM_RIGHTS). It holds no thread when it forks: the worker builds its compiler (and
xgrammar's thread pool) after the fork. A worker compiles one `(job_id, GrammarSpec)` at a
time: it checks the spec's limits, compiles it and answers `Reply` with the compiled grammar
as `CompiledGrammar.serialize_json()` text, or the error. The parent kills a worker to stop
its compile; the template reaps it. Both exit when the parent closes its socket or dies.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from radixrt.grammar.spec import GrammarSpec

BOOT = "import sys; from radixrt.grammar.compile_worker import main; main(int(sys.argv[1]))"
FORK = "fork"  # the parent's request for one more worker
COMPILE_THREADS = 4  # threads xgrammar uses inside one compile
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    model_path: str
    vocab_size: int  # the model's (logits width); may exceed the tokenizer's
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TemplateReady:
    tokenizer_info_json: str  # xgr.TokenizerInfo.serialize_json()
    no_control_mask: bytes  # [ceil(V / 32)] int32: tokens without bytes < 0x20 (see below)


@dataclass(frozen=True, slots=True)
class SetupFailed:
    traceback: str


@dataclass(frozen=True, slots=True)
class Reply:
    """A finished compile: exactly one of `grammar_json` and `error`."""

    job_id: int
    grammar_json: str | None = None  # xgr.CompiledGrammar.serialize_json()
    error: str | None = None  # the request's fault (a 400), or with `internal` the engine's
    internal: bool = False


class CompileError(ValueError):
    """The spec does not compile (bad regex, schema or grammar, over a limit, or a language
    no output can match)."""


def main(fd: int) -> None:
    """The template process."""
    import signal
    import socket
    from multiprocessing.connection import Connection

    _die_with_parent()
    os.dup2(2, 1)  # stray prints of libraries go to stderr
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    setup: WorkerSetup = conn.recv()
    try:
        template = _Template(setup)
    except Exception:
        conn.send(SetupFailed(traceback.format_exc()))
        return
    conn.send(TemplateReady(template.info.serialize_json(), template.no_control.tobytes()))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they exit
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        assert request == FORK, request
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker
            _die_with_parent()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            conn.close()
            sock.close()
            ours.close()
            code = 0
            try:
                template.serve(Connection(theirs.detach()))
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        theirs.close()
        conn.send(pid)
        socket.send_fds(sock, [b"w"], [ours.fileno()])
        ours.close()


def _die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when its parent exits: a worker in a
    long compile reads no socket, so it would not notice a parent that crashed."""
    if sys.platform == "linux":
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


class _Template:
    """What every worker starts from: the tokenizer's xgrammar view, built once."""

    def __init__(self, setup: WorkerSetup) -> None:
        import xgrammar as xgr

        from radixrt.hf_dir import load_tokenizer

        tok = load_tokenizer(setup.model_path)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=setup.vocab_size, stop_token_ids=list(setup.stop_token_ids)
        )
        keep = [*self.info.stop_token_ids, *tok.all_special_ids]
        self.no_control = no_control_mask(self.info, setup.vocab_size, keep)
        self.vocab_size = setup.vocab_size

    def serve(self, conn) -> None:
        """A worker's life: compile what the parent sends until it closes the socket."""
        worker = _Compiler(self)
        while True:
            try:
                job_id, spec = conn.recv()
            except (EOFError, OSError):
                return
            conn.send(worker.compile(job_id, spec))


class _Compiler:
    def __init__(self, template: _Template) -> None:
        import xgrammar as xgr

        # no cache here: the parent caches compiled grammars (bounded in bytes)
        self.compiler = xgr.GrammarCompiler(
            template.info, max_threads=COMPILE_THREADS, cache_enabled=False
        )
        self.vocab_size = template.vocab_size

    def compile(self, job_id: int, spec: GrammarSpec) -> Reply:
        try:
            return Reply(job_id, grammar_json=self._compile(spec).serialize_json())
        except CompileError as e:
            return Reply(job_id, error=str(e))
        except Exception as e:  # not the request's fault
            print(traceback.format_exc(), file=sys.stderr)
            return Reply(job_id, error=f"internal error compiling the {spec.field}: {e!r}",
                         internal=True)  # fmt: skip

    def _compile(self, spec: GrammarSpec):
        import xgrammar as xgr

        from radixrt.grammar.json_schema_support import check_json_schema
        from radixrt.grammar.regex_limits import check_regex

        try:  # limits and unsupported keywords, before any compile time is spent
            if spec.kind == "regex":
                check_regex(spec.text, spec.field)
            elif spec.kind == "json_schema":
                check_json_schema(json.loads(spec.text), spec.field)
        except ValueError as e:
            raise CompileError(str(e)) from None
        c = self.compiler
        try:
            if spec.kind == "regex":
                grammar = c.compile_grammar(no_surrogates(xgr.Grammar.from_regex(spec.text)))
            elif spec.kind == "json_schema":
                # compact JSON (no free whitespace): bounded outputs, more forced tokens
                schema = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
                grammar = c.compile_grammar(no_surrogates(schema))
            elif spec.kind == "structural_tag":
                grammar = c.compile_structural_tag(compact_tag(spec.text, spec.field))
            else:
                assert spec.kind == "ebnf", spec.kind
                grammar = c.compile_grammar(no_surrogates(xgr.Grammar.from_ebnf(spec.text)))
        except (RuntimeError, ValueError, TypeError, xgr.InvalidStructuralTagError) as e:
            message = _LOCATION.sub("", str(e).strip())
            raise CompileError(f"invalid {spec.field}: {message}") from None
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.numpy().any():
            raise CompileError(
                f"invalid {spec.field}: no output can match it (it matches no string, or no "
                "token of the model's vocabulary starts a match)"
            )
        return grammar


def compact_tag(text: str, field: str) -> str:
    """A structural tag (JSON text) whose JSON-schema contents are compact JSON grammars, as
    `json_schema` requests get: no free whitespace (a tool call's arguments cannot spend its
    budget on blanks, and separators are forced), surrogates left out, and the schema
    keywords checked (CompileError naming what is not enforced)."""
    import xgrammar as xgr

    from radixrt.grammar.json_schema_support import check_json_schema

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(x) for x in node]
        if not isinstance(node, dict):
            return node
        schema = node.get("json_schema")
        plain = node.get("style", "json") == "json" and not node.get("any_order")
        if node.get("type") == "json_schema" and isinstance(schema, dict) and plain:
            try:
                check_json_schema(schema, field)
            except ValueError as e:
                raise CompileError(str(e)) from None
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            return {"type": "grammar", "grammar": str(no_surrogates(grammar))}
        return {k: convert(v) for k, v in node.items()}

    try:
        tag = json.loads(text)
    except ValueError:
        return text  # the compile reports it
    return json.dumps(convert(tag))


def no_surrogates(grammar):
    """`grammar` (an xgrammar Grammar) with U+D800..U+DFFF left out of every negated character
    class: xgrammar 0.2.9 decodes the bytes ED A0..BF xx as those code points and lets `[^"]`
    take them, but no UTF-8 text holds them (the detokenizer makes each such byte a U+FFFD,
    three characters where the grammar counted one: a maxLength string came out too long).
    Only classes are rewritten; string literals of the grammar text are copied as they are."""
    import xgrammar as xgr

    text = str(grammar)
    out = []
    i, n, state = 0, len(text), "rule"  # rule | literal ("...") | class ([...])
    while i < n:
        ch = text[i]
        out.append(ch)
        if state != "rule" and ch == "\\" and i + 1 < n:
            out.append(text[i + 1])
            i += 2
            continue
        if state == "rule" and ch == '"':
            state = "literal"
        elif state == "literal" and ch == '"':
            state = "rule"
        elif state == "rule" and ch == "[":
            state = "class"
            if text.startswith("[^", i):
                out.append("^\\uD800-\\uDFFF")
                i += 1
        elif state == "class" and ch == "]":
            state = "rule"
        i += 1
    return xgr.Grammar.from_ebnf("".join(out))


def no_control_mask(info, vocab_size: int, keep_ids):
    """[ceil(V / 32)] int32: bit t set unless token t's bytes hold a control byte (< 0x20);
    `keep_ids` (stop and special tokens) stay allowed. Ids past the tokenizer's vocabulary
    (a padded model vocabulary) decode to b"" and stay allowed too (xgrammar masks them).
    Not `info.special_token_ids`: for a padded vocabulary it lists every padding id, one
    FFI call each, which under GIL contention took minutes. JSON forbids raw control bytes
    in strings, which xgrammar 0.2.9 lets maxLength strings take."""
    import numpy as np

    allowed = np.ones(vocab_size, dtype=bool)
    keep = set(keep_ids)
    for t, piece in enumerate(info.decoded_vocab[:vocab_size]):
        if t not in keep and any(b < 0x20 for b in piece):
            allowed[t] = False
    padded = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    padded[:vocab_size] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32).copy()
