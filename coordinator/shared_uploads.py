"""Waiting for the uploads a run gathers once before round 1 (SDA-FL's synthetic samples, FedMix's means): one wait,
bounded, for both."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from fedsynth.errors import QuorumError

POLL_S = 0.5  # an upload notifies the lock; the poll only bounds the wait's overshoot of its deadline


def await_uploads(lock: threading.Condition, uploaded: Callable[[], Collection[int]], registered: list[int], *,
                  timeout_s: float, need: int, what: str) -> None:
    """With `lock` held (uploads notify it): wait until every registered client is in `uploaded()` or `timeout_s`
    passes; QuorumError when fewer than `need` uploaded."""
    stop_at = time.monotonic() + timeout_s
    while not set(registered) <= set(uploaded()) and time.monotonic() < stop_at:
        lock.wait(timeout=POLL_S)
    got = len(uploaded())
    if got < need:
        raise QuorumError(f"only {got} of {len(registered)} clients uploaded {what} within {timeout_s:.0f}s")
