"""Helpers for tests that drive an engine in-process."""

from __future__ import annotations

import time


def wait_no_holds(retention, timeout_s: float = 10.0) -> None:
    """Wait until the engine's retention feature holds nothing (releases go through the
    engine thread's inbox), then assert that it holds nothing."""
    deadline = time.monotonic() + timeout_s
    while retention.holds and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not retention.holds
