"""Shared fixtures: the tiny checkpoint (built once per session) and engines over it
whose KV accounting is checked when each test ends."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from radixrt.model.tiny import ensure_tiny_model

    path = os.environ.get("RADIXRT_TINY_MODEL_DIR") or str(
        tmp_path_factory.getbasetemp() / "tiny-llama"
    )
    return ensure_tiny_model(path)


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for CPU float32 engines on the tiny model; every engine it made is checked
    at teardown: integrity holds and no request holds KV."""
    from radixrt import Engine

    engines = []

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        engine = Engine(tiny_model_dir, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_idle(engine)


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
