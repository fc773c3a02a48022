"""Native CPU kernels: C sources in kernels/csrc, compiled on first use and loaded with ctypes.

`load_library(name)` compiles `csrc/<name>.c` with the system C compiler (`$CC`, else cc, gcc
or clang on PATH) into `~/.cache/radixrt/native/<name>-<key>.so` (`$RADIXRT_NATIVE_CACHE`
moves it), the key a hash of the source (and of every csrc file it may include), the compiler's
version, the flags and the CPU (so a cache shared by two kinds of machine keeps one library per
kind), atomically (a temp file
renamed into place: processes that build at once each get a whole library). It returns None,
after logging why once, when no compiler is found, the build fails, the cache cannot be
written, or RADIXRT_NATIVE_KERNELS=0; callers then use their torch path.

Flags: -O3, the host's vector ISA (-march=native, -mcpu=native on Arm) and -fopenmp (parallel
regions on the OpenMP runtime torch has loaded), retried without -fopenmp and then without the
ISA flag; -fopenmp-simd (the sources' `omp simd` loops), -pthread. No Python headers and no
torch headers: a build takes well under a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-pthread", "-std=c11")
DISABLE_ENV = "RADIXRT_NATIVE_KERNELS"  # "0": never build or load (the torch paths run)


# every library a CPU float32 forward loads (what `prebuild` compiles when an engine starts)
CPU_LIBRARIES = ("paged_decode", "paged_extend")
CACHE_ENV = "RADIXRT_NATIVE_CACHE"  # where built libraries go (default ~/.cache/radixrt/native)


def enabled() -> bool:
    """False where RADIXRT_NATIVE_KERNELS=0 (nothing is built or loaded)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/radixrt/native"))


# the status codes every native entry point returns (0: ok)
STATUS = {1: "out of memory", 2: "bad arguments", 3: "an index out of range"}


def check_status(rc: int, what: str) -> None:
    """Raise RuntimeError naming `what` and the failure if a native call returned rc != 0."""
    if rc != 0:
        raise RuntimeError(f"{what} failed: {STATUS.get(rc, f'status {rc}')}")


# `bind` signature letters -> ctypes argument types
_CTYPES = {"p": ctypes.c_void_p, "q": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}


class NativeFunction:
    """One C entry point that returns a status (0: ok); calling it raises RuntimeError on any
    other status (`check_status`)."""

    def __init__(self, fn: ctypes._CFuncPtr, what: str) -> None:
        self._fn, self._what = fn, what

    def __call__(self, *args: int | float | None) -> None:
        check_status(self._fn(*args), self._what)


def bind(
    name: str, symbol: str, signature: str, defines: tuple[str, ...] = ()
) -> NativeFunction | None:
    """`symbol` of the library `csrc/<name>.c` built with `defines` (`load_library`), with its
    argument types one letter each in `signature` (p: pointer, q: int64, i: int, f: float),
    returning an int status; None where the library cannot be built or loaded."""
    lib = load_library(name, defines)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [_CTYPES[c] for c in signature]
    return NativeFunction(fn, f"native {symbol}")


def find_compiler() -> str | None:
    """The C compiler to use: $CC if set, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    for cc in ("cc", "gcc", "clang"):
        path = shutil.which(cc)
        if path:
            return path
    return None


def _arch_flags() -> tuple[str, ...]:
    return ("-mcpu=native",) if platform.machine() in ("arm64", "aarch64") else ("-march=native",)


@functools.cache
def _cpu_signature() -> str:
    """What the compiled code depends on beyond the source: the CPU's model and features."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else ""


def _build(cc: str, source: Path, target: Path, defines: tuple[str, ...]) -> str | None:
    """Compile `source` into `target` (atomically); returns None, or the compiler's error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for arch in ((*_arch_flags(), "-fopenmp"), _arch_flags(), ()):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *BASE_FLAGS, *arch, *(f"-D{d}" for d in defines), str(source), "-o", tmp]
        cmd.append("-lm")
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode == 0:
                os.replace(tmp, target)
                return None
            error = res.stderr.strip()[-2000:]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return error


@functools.cache
def load_library(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.c`, built if needed; None (logged once) if it cannot be.
    `defines`: preprocessor macros (-D) the source reads (tests: RADIXRT_PORTABLE)."""
    if not enabled():
        logger.info("native kernels off (%s=0): %s uses the torch path", DISABLE_ENV, name)
        return None
    source = SOURCES / f"{name}.c"
    cc = find_compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC): %s uses the slower torch path", name)
        return None
    try:
        return _load(cc, source, defines)
    except (OSError, subprocess.SubprocessError) as e:  # read-only cache, a hung compiler, ...
        logger.warning("native kernel %s unavailable (%s): using the torch path", name, e)
        return None


def prebuild(names: tuple[str, ...]) -> None:
    """Compile the libraries of `names` that are not in the cache yet, all at once (one
    compiler process each, in parallel), so that the `load_library` calls that follow find
    them built: a CPU engine's first start builds its five kernels in about the time of the
    largest. Does nothing where `load_library` would not build (no compiler, disabled);
    failures are left for `load_library` to report."""
    cc = find_compiler()
    if cc is None or not enabled():
        return
    jobs = []
    for name in names:
        try:
            source = SOURCES / f"{name}.c"
            target = _target(cc, source, ())
            if not target.exists():
                jobs.append(threading.Thread(target=_build, args=(cc, source, target, ())))
        except (OSError, subprocess.SubprocessError):
            return
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()


def _headers() -> list[str]:
    """The texts of every csrc file (sources include headers and other sources): part of
    every library's key."""
    return [f.read_text() for f in sorted([*SOURCES.glob("*.h"), *SOURCES.glob("*.c")])]


def _target(cc: str, source: Path, defines: tuple[str, ...]) -> Path:
    """Where the library built from `source` with `defines` by `cc` is cached."""
    key = hashlib.sha256(
        "\0".join(
            [source.read_text(), *_headers(), _compiler_version(cc), " ".join(BASE_FLAGS + defines)]
            + [_cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _load(cc: str, source: Path, defines: tuple[str, ...]) -> ctypes.CDLL | None:
    target = _target(cc, source, defines)
    if not target.exists():
        error = _build(cc, source, target, defines)
        if error is not None:
            logger.warning("building %s failed, using the torch path:\n%s", source, error)
            return None
        logger.info("built %s", target)
    return ctypes.CDLL(str(target))
