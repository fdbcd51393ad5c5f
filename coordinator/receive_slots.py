"""At most N large client uploads received at once (each holds a model-sized buffer); the others wait for a slot, boundedly."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

UPLOAD_SLOTS = 2  # ResNet-18: two 45 MB receive buffers at a time, however many clients answer at once
SLOTTED_UPLOAD_BYTES = 4 << 20  # smaller updates (a small CNN's: ~0.2 MB) are received at once, without a slot
POLL_S = 0.25  # how soon a waiter notices that its own RPC ended (a freed slot is handed to it at once)


class UploadCancelled(Exception):
    """The upload's RPC ended (deadline, cancel, broken stream) while it waited for a slot."""


class ReceiveSlots:
    """A first-come-first-served limit on concurrent uploads with two ways out of the queue, so that no upload waits
    unboundedly: a waiter whose RPC ends leaves the queue (UploadCancelled), and one that has waited `bypass_after_s`
    (a stalled sender may be holding a slot: it must not block the round) is received without a slot.

    A freed slot is handed to the head of the queue directly (its own event: one thread woken, not every waiter; at
    K = 100 waking all of them on every release cost most of a second per round). A holder gives its slot back however
    its `with` block ends: done, refused, or its stream broken off."""

    def __init__(self, slots: int = UPLOAD_SLOTS, *, bypass_after_s: float) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.bypass_after_s = bypass_after_s
        self._lock = threading.Lock()
        self._queue: deque[threading.Event] = deque()  # one event per waiter, set when a slot is handed to it
        self.held = 0
        self.bypassed = 0  # uploads received without a slot since start

    @property
    def waiting(self) -> int:
        with self._lock:
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
                self._release()

    def _release(self) -> None:
        with self._lock:
            self._release_locked()

    def _acquire(self, is_active: Callable[[], bool], what: str) -> bool:
        started = time.monotonic()
        with self._lock:
            if self.held < self.slots and not self._queue:
                self.held += 1
                return True
            turn = threading.Event()
            self._queue.append(turn)
        while True:
            waited = time.monotonic() - started
            if turn.wait(timeout=max(0.0, min(POLL_S, self.bypass_after_s - waited))):
                return True
            active = is_active()
            with self._lock:
                if turn.is_set():  # handed over while we looked away
                    if active:
                        return True
                    self._release_locked()
                    raise UploadCancelled(f"{what} ended while it waited {waited:.1f}s for a receive slot")
                waited = time.monotonic() - started
                if not active:
                    self._queue.remove(turn)
                    raise UploadCancelled(f"{what} ended while it waited {waited:.1f}s for a receive slot")
                if waited >= self.bypass_after_s:
                    self._queue.remove(turn)
                    self.bypassed += 1
            if waited >= self.bypass_after_s:
                log.warning("%s waited %.1fs for one of %d receive slots (a sender may be stalled); receiving it without one",
                            what, waited, self.slots)
                return False

    def _release_locked(self) -> None:
        if self._queue:
            self._queue.popleft().set()  # the slot passes to the next in line: `held` stays as it is
        else:
            self.held -= 1
