"""Shared fixtures: the tiny checkpoints (trained and random, built once into the shared cache)
and engines over them whose KV accounting is checked when each test ends."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True, scope="session")
def _fixed_cpu_threads():
    """Every CPU engine of the run gets the same thread count (the default depends on the
    machine's load at start-up, and engines compared with each other must sum in the same
    order): half the cores, as the default was before it became load-aware."""
    import radixrt.config

    real = radixrt.config.default_cpu_threads
    radixrt.config.default_cpu_threads = lambda: max(1, (os.cpu_count() or 1) // 2)
    yield real
    radixrt.config.default_cpu_threads = real


@pytest.fixture
def real_default_cpu_threads(_fixed_cpu_threads):
    """radixrt.config.default_cpu_threads itself (the run pins a fixed one)."""
    return _fixed_cpu_threads


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The trained tiny model: `ensure_tiny_model()`, built once into the shared cache dir
    (`$RADIXRT_TINY_MODEL_DIR`, else under ~/.cache/radixrt; 1-2 minutes the first time,
    then reused by every later run)."""
    from radixrt.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_random_model_dir() -> str:
    """The same tiny Llama with random weights (`ensure_tiny_model(random=True)`)."""
    from radixrt.model.tiny import ensure_tiny_model

    return ensure_tiny_model(random=True)


@pytest.fixture(scope="session")
def native_kernel():
    """The native CPU decode kernel. Skips only where no C compiler exists or native kernels
    are off (RADIXRT_NATIVE_KERNELS=0); otherwise a kernel that does not build fails the test."""
    from radixrt.kernels.native import DISABLE_ENV, enabled, find_compiler
    from radixrt.kernels.paged_decode_cpu import load_paged_decode

    if not enabled():
        pytest.skip(f"{DISABLE_ENV}=0: native kernels are off")
    if find_compiler() is None:
        pytest.skip("no C compiler: the native CPU kernel cannot be built")
    kernel = load_paged_decode()
    assert kernel is not None, "a C compiler exists but the native kernel did not build"
    return kernel


@pytest.fixture
def one_thread():
    """One torch thread: on a shared, oversubscribed CPU two threads can be 10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for CPU float32 engines on the tiny model (or on `model`, a model dir); every
    engine it made is checked at teardown: integrity holds and no request holds KV."""
    from radixrt import Engine

    engines = []

    def make(model: str | None = None, **options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        if options["device"].startswith("cuda"):
            # several engines of one test share the GPU: none may size its pool to fill it
            options.setdefault("num_kv_blocks", 4096)
        engine = Engine(model or tiny_model_dir, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_idle(engine)
    for engine in engines:
        engine.shutdown()  # frees the KV pool now, not when the collector gets to it


def assert_idle(engine) -> None:
    """Integrity holds and every block is free or held by the prefix cache alone."""
    while engine.core.has_work and not engine.scheduler.has_work:
        engine.core.step()  # the result of a step still in flight (overlap)
    engine.check_integrity()
    assert not engine.core.has_work
    alloc = engine.allocator
    assert alloc.num_free + engine.cache.cached_blocks == alloc.num_blocks, (
        f"{alloc.num_blocks - alloc.num_free - engine.cache.cached_blocks} blocks leaked"
    )


@pytest.fixture
def batch_admissions(monkeypatch) -> list:
    """The `BatchAdmission`s that `run_batch` makes during the test, in order."""
    import radixrt.frontend.program as program
    from radixrt.frontend.admission import BatchAdmission

    made = []

    class Recorded(BatchAdmission):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(program, "BatchAdmission", Recorded)
    return made
