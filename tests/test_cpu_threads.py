"""The in-process CPU engine's default thread count: the cores not busy at start-up."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize(
    ("cores", "load", "want"),
    [(2, 0.1, 2), (2, 0.8, 1), (2, 1.2, 1), (2, 6.0, 1), (8, 0.0, 8), (8, 2.6, 5), (1, 0.0, 1)],
)
def test_default_cpu_threads_leaves_busy_cores(
    monkeypatch, real_default_cpu_threads, cores, load, want
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert real_default_cpu_threads() == want


def test_default_cpu_threads_without_a_load_average(monkeypatch, real_default_cpu_threads):
    def no_load():
        raise OSError("no load average")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(os, "getloadavg", no_load)
    assert real_default_cpu_threads() == 2


def test_resolve_config_uses_it(monkeypatch):
    import radixrt.config

    monkeypatch.setattr(radixrt.config, "default_cpu_threads", lambda: 3)
    cfg = radixrt.config.resolve_config("m", "cpu", "float32", detect_devices=False)
    assert cfg.cpu_threads == 3
