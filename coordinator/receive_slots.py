"""At most N client uploads received at once (each holds a model-sized buffer); the others wait for a slot, boundedly."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

UPLOAD_SLOTS = 2  # ResNet-18: two 45 MB receive buffers at a time, however many clients answer at once
POLL_S = 0.25  # how soon a waiter notices that its own RPC ended (a slot freed wakes it at once)


class UploadCancelled(Exception):
    """The upload's RPC ended (deadline, cancel, broken stream) while it waited for a slot."""


class ReceiveSlots:
    """A first-come-first-served limit on concurrent uploads with two ways out of the queue, so that no upload waits
    unboundedly: a waiter whose RPC ends leaves the queue (UploadCancelled), and one that has waited `bypass_after_s`
    (a stalled sender may be holding a slot: it must not block the round) is received without a slot.

    A holder gives its slot back however its `with` block ends: done, refused, or its stream broken off."""

    def __init__(self, slots: int = UPLOAD_SLOTS, *, bypass_after_s: float) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.bypass_after_s = bypass_after_s
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self.held = 0
        self.bypassed = 0  # uploads received without a slot since start

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    @contextmanager
    def hold(self, is_active: Callable[[], bool] = lambda: True, *, what: str = "an upload") -> Iterator[bool]:
        """Wait for a slot and hold it for the block; yields False when the wait ran out and the block runs without one.
        `is_active` is polled while waiting: once it returns False the wait ends with UploadCancelled."""
        held = self._acquire(is_active, what)
        try:
            yield held
        finally:
            if held:
                with self._cond:
                    self.held -= 1
                    self._cond.notify_all()

    def _acquire(self, is_active: Callable[[], bool], what: str) -> bool:
        ticket = object()
        started = time.monotonic()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self.held < self.slots):
                    waited = time.monotonic() - started
                    if waited >= self.bypass_after_s:
                        self.bypassed += 1
                        log.warning("%s waited %.1fs for one of %d receive slots (a sender may be stalled); receiving it without one",
                                    what, waited, self.slots)
                        return False
                    if not is_active():
                        raise UploadCancelled(f"{what} ended while it waited {waited:.1f}s for a receive slot")
                    self._cond.wait(timeout=min(POLL_S, self.bypass_after_s - waited))
                self.held += 1
                return True
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may now be at the head
