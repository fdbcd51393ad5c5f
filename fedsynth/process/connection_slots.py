"""A cap on a threaded server's open connections, each with a whole deadline: idle or trickling peers cannot hold its threads."""

from __future__ import annotations

import socket
import threading
import time


class Slot:
    """One admitted connection: when it was accepted, its deadline, and a second handle on its socket that the
    reaper shuts down (the connection's own object may be wrapped by TLS meanwhile; shutdown acts on the socket)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.accepted = time.monotonic()
        self.deadline = deadline
        self.requested = False  # its request (TLS handshake, request line, headers) has been read
        self.cut = False
        self._handle = sock.dup()

    def shut(self) -> None:
        """End the connection now: a thread blocked reading or writing it returns at once."""
        self.cut = True
        try:
            self._handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is gone already

    def close(self) -> None:
        self._handle.close()


class ConnectionSlots:
    """At most `limit` connections at once. Each is shut down `request_s` after it was accepted unless its request
    has been read by then (a TLS handshake and HTTP headers take milliseconds; a port scan or a slow-loris peer
    never finishes), and `response_s` after it was accepted in any case. At the limit, a new connection takes the
    slot of the oldest one still sending its request, so a flood of idle connections delays a scrape by no more than
    that eviction; when every slot is past its request, the accept loop waits (at most `response_s`) for one."""

    def __init__(self, limit: int, *, request_s: float, response_s: float) -> None:
        self.limit = limit
        self.request_s = request_s
        self.response_s = response_s
        self._cond = threading.Condition()
        self._open: list[Slot] = []
        self._closed = False
        self.evicted = 0  # connections ended to make room (idle peers at the limit)
        self.expired = 0  # connections ended at their deadline
        threading.Thread(target=self._reap, name="connection-deadlines", daemon=True).start()

    def admit(self, sock: socket.socket) -> Slot | None:
        """A slot for a just-accepted connection (called from the accept loop); None once closed."""
        with self._cond:
            while len(self._open) >= self.limit and not self._closed:
                pending = [s for s in self._open if not s.requested and not s.cut]
                if pending:
                    min(pending, key=lambda s: s.accepted).shut()
                    self.evicted += 1
                self._cond.wait(0.2)  # until the shut connection's thread released its slot
            if self._closed:
                return None
            slot = Slot(sock, time.monotonic() + self.request_s)
            self._open.append(slot)
            self._cond.notify_all()  # the reaper's next deadline may be this one
            return slot

    def mark_requested(self, slot: Slot) -> None:
        """Its request has been read: it may now take until `response_s` after its acceptance."""
        with self._cond:
            slot.requested = True
            slot.deadline = slot.accepted + self.response_s

    def release(self, slot: Slot) -> None:
        with self._cond:
            if slot in self._open:
                self._open.remove(slot)
            slot.close()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for slot in self._open:
                slot.shut()
            self._cond.notify_all()

    def open_count(self) -> int:
        with self._cond:
            return len(self._open)

    def _reap(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for slot in self._open:
                    if not slot.cut and slot.deadline <= now:
                        slot.shut()
                        self.expired += 1
                waiting = [s.deadline for s in self._open if not s.cut]
                self._cond.wait(max(0.01, min(waiting) - now) if waiting else None)
