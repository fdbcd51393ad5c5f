"""Updates folded off their RPC: a sender hears back once its update is received and checked, and the fold into the
round's running sum follows on one thread, in the order the updates were accepted; a round closes only after its
last fold.

Folding a ResNet-18 update takes ~12 ms (BENCHMARKS.md); done inside SubmitUpdate it delayed every client's answer
by that much, and on 2 cores it competed with the next upload. A received update waiting here holds its buffer, so at
most `backlog` of them wait: the next one's RPC waits (boundedly) for a place, as it waited for the fold before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from coordinator.rounds import RoundInProgress
from fedsynth.errors import StateError, WireError

log = logging.getLogger(__name__)

FOLD_BACKLOG = 1  # received updates waiting for their fold (a fold is ~4x faster than a ResNet-18 upload)
PLACE_WAIT_S = 60.0  # the most an accepted update waits for a place in the backlog
FOLDS_WAIT_S = 120.0  # the most a closing round waits for its accepted updates to be folded


class UpdateFolds:
    """One fold thread for the coordinator; `lock` is the federation's (a fold runs under it, as the round's
    bookkeeping does)."""

    def __init__(self, lock: threading.Condition, backlog: int = FOLD_BACKLOG,
                 refuse: Callable[[RoundInProgress, int, str], None] | None = None) -> None:
        self.lock = lock
        self.refuse = refuse  # (round, client, why): an update the fold refused, left out of the round (under the lock)
        self._places = threading.BoundedSemaphore(backlog)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fold")

    def reserve(self, what: str) -> None:
        """Wait for a place in the backlog (call before taking the lock; `submit` uses it, `cancel` gives it back)."""
        if not self._places.acquire(timeout=PLACE_WAIT_S):
            raise StateError(f"{what} waited {PLACE_WAIT_S:.0f}s for the updates before it to be folded")

    def cancel(self) -> None:
        self._places.release()

    def submit(self, rnd: RoundInProgress, client_id: int, fold: Callable[[], None]) -> None:
        """Fold an accepted update (recorded as answered by the caller, under the lock) on the fold thread."""
        rnd.folding += 1
        self._thread.submit(self._fold, rnd, client_id, fold)

    def _fold(self, rnd: RoundInProgress, client_id: int, fold: Callable[[], None]) -> None:
        try:
            with self.lock:
                started = time.monotonic()
                try:
                    fold()
                except (WireError, ValueError) as exc:  # the aggregator's checks, which raise before the sum changes
                    message = f"round {rnd.number}: client {client_id}'s update could not be folded: {exc}"
                    if self.refuse is None:
                        rnd.fold_errors.append(message)
                    else:
                        self.refuse(rnd, client_id, message)
                except Exception as exc:  # a bug past the checks: the sum may hold part of the update
                    log.exception("round %d: client %d's update could not be folded", rnd.number, client_id)
                    rnd.fold_errors.append(f"client {client_id}: {type(exc).__name__}: {exc}")
                rnd.aggregation_s += time.monotonic() - started
                rnd.folding -= 1
                self.lock.notify_all()
        finally:
            self._places.release()

    def wait_for(self, rnd: RoundInProgress) -> None:
        """Block (under no lock) until every update accepted for `rnd` is folded. A fold that failed (a bug: every update
        is checked before it is accepted) may have left part of itself in the sum: the run stops at its last checkpoint
        rather than publish that model."""
        with self.lock:
            if not self.lock.wait_for(lambda: rnd.folding == 0, timeout=FOLDS_WAIT_S):
                raise RuntimeError(f"round {rnd.number}: {rnd.folding} accepted updates not folded within {FOLDS_WAIT_S:.0f}s")
            if rnd.fold_errors:
                raise RuntimeError(f"round {rnd.number}: updates could not be folded: {'; '.join(rnd.fold_errors)}")

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
