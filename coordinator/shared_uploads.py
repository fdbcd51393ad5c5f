"""Waiting for the uploads a run gathers once before round 1 (SDA-FL's synthetic samples, FedMix's means): one wait,
bounded, for both."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping

from fedsynth.errors import QuorumError

log = logging.getLogger(__name__)

POLL_S = 0.5  # an upload notifies the lock; the poll only bounds the wait's overshoot of its deadline


def await_uploads(lock: threading.Condition, uploaded: Callable[[], Collection[int]], registered: list[int], *,
                  timeout_s: float, need: int, what: str, failed: Callable[[], Mapping[int, str]] = dict) -> None:
    """With `lock` held (uploads and failure reports notify it): wait until every registered client is in `uploaded()`
    or `failed()` (a client that reported it will not upload) or `timeout_s` passes; QuorumError, naming the
    failures, when fewer than `need` uploaded."""
    stop_at = time.monotonic() + timeout_s
    while not set(registered) <= set(uploaded()) | set(failed()) and time.monotonic() < stop_at:
        lock.wait(timeout=POLL_S)
    got = len(uploaded())
    failures = "; ".join(f"client {c}: {why}" for c, why in sorted(failed().items()))
    if got < need:
        within = f"(quorum {need}; {failures})" if failures else f"within {timeout_s:.0f}s"
        raise QuorumError(f"only {got} of {len(registered)} clients uploaded {what} {within}")
    if failures:
        log.warning("going on with the %s of %d of %d clients (quorum %d); %s", what, got, len(registered), need, failures)
