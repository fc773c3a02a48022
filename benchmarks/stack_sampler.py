"""Where a benchmark's threads spend their time: every thread's Python stack sampled at an
interval while a labelled phase runs (`with sampler.phase("radix/mmlu"): ...`), counted by
(phase, thread, stack). One process, no ptrace (py-spy needs it and cannot tell phases
apart). The engine thread's stacks show its step, the GPU waits (a `synchronize`) and
anything else that stalls it (a kernel compiled mid-run appears as Triton's compiler in a
`subprocess` wait).

    python -m benchmarks.bench_programs ... --sample-stacks stacks.json
    python -m benchmarks.stack_sampler stacks.json --phase radix/mmlu [--thread NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator

ENGINE_THREAD = "radixrt-frontend-engine"  # EngineBackend's engine thread


def _thread_kind(name: str) -> str:
    """A thread's name without its pool number (radixrt-batch_12 -> radixrt-batch)."""
    return re.sub(r"[_-]?\d+$", "", name)


def _stack(frame) -> str:
    """Outermost first, `function@file:first line` per frame, the innermost with its
    current line."""
    leaf = f"{frame.f_code.co_name}@{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
    frames = []
    frame = frame.f_back
    while frame is not None:
        code = frame.f_code
        frames.append(f"{code.co_name}@{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}")
        frame = frame.f_back
    return ";".join([*reversed(frames), leaf])


class StackSampler:
    """Samples every other thread's stack each `interval_s` while a phase is open."""

    def __init__(self, interval_s: float = 0.004) -> None:
        self.interval_s = interval_s
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.ticks: Counter[str] = Counter()  # samples taken per phase
        self._phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        self._phase = label
        try:
            yield
        finally:
            self._phase = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            label = self._phase
            if label is None:
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            self.ticks[label] += 1
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    kind = _thread_kind(names.get(ident, "?"))
                    self.counts[(label, kind, _stack(frame))] += 1

    def save(self, path: str) -> None:
        rows = [[p, t, s, n] for (p, t, s), n in self.counts.items()]
        with open(path, "w") as f:
            json.dump(
                {"interval_s": self.interval_s, "ticks": dict(self.ticks), "samples": rows}, f
            )


def summary(path: str, phase: str, thread: str = ENGINE_THREAD, top: int = 25) -> str:
    """The thread's frames by the share of the phase's samples they were on the stack
    (inclusive), then its innermost frames (exclusive)."""
    with open(path) as f:
        data = json.load(f)
    inclusive: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for p, t, stack, n in data["samples"]:
        if p != phase or t != thread:
            continue
        frames = stack.split(";")
        total += n
        leaves[";".join(frames[-3:])] += n
        for fr in set(frames):
            inclusive[fr] += n
    if not total:
        phases = sorted({(p, t) for p, t, _, _ in data["samples"]})
        return f"no samples of {thread!r} in {phase!r}; there are: {phases}"
    lines = [f"{phase}, {thread}: {total} samples"]
    lines += ["inclusive:"] + [f"{n / total:6.1%}  {fr}" for fr, n in inclusive.most_common(top)]
    lines += ["innermost:"] + [f"{n / total:6.1%}  {fr}" for fr, n in leaves.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path")
    p.add_argument("--phase", required=True, help="e.g. radix/mmlu (config/program)")
    p.add_argument("--thread", default=ENGINE_THREAD)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    print(summary(args.path, args.phase, args.thread, args.top))


if __name__ == "__main__":
    main()
