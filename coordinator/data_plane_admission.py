"""The data plane's front door: one thread accepts connections, completes each TLS handshake and reads each request
header without blocking, under one deadline per connection and a cap per peer address. Only a whole, well-formed
request reaches a worker, so a peer that connects and idles or trickles never holds one.

Why not a deadline per read in the workers: 48 connections that each sent one byte every 4 s held all 32 workers
(each read met its 6 s deadline) and stalled a round for as long as they kept at it (docs/runtime.md).

An admitted request then waits for a worker in a TransferQueue: bounded in all and per address, each wait with a
deadline. When accept() itself fails (out of file descriptors), the loop stops accepting for a while, growing the
pause, instead of retrying at once: the listener stays readable, and a retry at once spun at ~70,000 log lines a second.
"""

from __future__ import annotations

import logging
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from fedsynth.errors import WireError
from fedsynth.wire import data_plane as wire

log = logging.getLogger(__name__)
ADMISSION_S = 1.0  # the TLS handshake and the whole request header, together: a client sends both at once
MAX_PENDING_PER_PEER = 32  # connections of one address still in admission; more are closed at once (UNAVAILABLE, retried)
MAX_PENDING_CEILING = 4096  # in admission from all addresses, however many file descriptors the process may open
POLL_S = 0.25  # how soon the loop notices stop()
# After a failed accept() (EMFILE, ENFILE, ENOBUFS...) the listener is left alone this long, doubled at each failure in a
# row: 10 ms lets a descriptor freed by a closing transfer be used almost at once; 1 s caps the wait of a connection in
# the backlog once descriptors are free again, and the log to one line (with the count of failures) a second.
ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
# Admitted requests waiting for one of the data plane's 32 workers: four per worker in all, and an eighth of that per
# address, so one address (a client's NAT, or a peer that holds valid tickets) cannot fill the queue. A request past
# either cap is refused UNAVAILABLE at once and the client retries.
MAX_QUEUED = 128
MAX_QUEUED_PER_PEER = 16
# The longest a request waits for a worker: then it is refused UNAVAILABLE ("queue_deadline"). Under the client's own
# 60 s stall timeout (fedsynth.wire.data_plane.STALL_S), so the client hears why instead of timing out; long enough for
# 32 workers to send four rounds of ResNet-18's 45 MB at 10 MB/s (4.5 s each) before anyone is turned away.
QUEUE_WAIT_S = 30.0
REFUSAL_SEND_S = 1.0  # a status is a few bytes into an empty send buffer: never waits in practice


def pending_cap(soft_nofile: int) -> int:
    """How many connections may be in admission at once, from the process's soft RLIMIT_NOFILE: half of it, so the
    other half stays for the gRPC server's connections, the transfer workers', files and checkpoints (1,024, the common
    soft limit, gives 512); RLIM_INFINITY gives the ceiling."""
    if soft_nofile == resource.RLIM_INFINITY or soft_nofile < 0:
        return MAX_PENDING_CEILING
    return max(1, min(MAX_PENDING_CEILING, soft_nofile // 2))


def host_of(peer: Any) -> str:
    """The address a per-address cap counts a peer under."""
    return peer[0] if isinstance(peer, tuple) else str(peer)


def refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    """Tell the peer why (its status, within REFUSAL_SEND_S) and close the connection; a peer gone already is no error."""
    try:
        conn.settimeout(REFUSAL_SEND_S)
        wire.send_status(conn, code, message)
    except (OSError, ssl.SSLError):
        pass
    finally:
        conn.close()


@dataclass(frozen=True)
class Request:
    """A connection whose request header arrived whole: blocking again, ready for a worker."""

    conn: socket.socket
    peer: Any
    op: int
    ticket: bytes
    header: bytes


@dataclass
class _Pending:
    sock: socket.socket
    peer: Any
    deadline: float
    handshaking: bool
    got: bytearray = field(default_factory=bytearray)
    need: int = wire.REQUEST_BYTES
    head: tuple[int, bytes, int] | None = None  # (op, ticket, header length) once the fixed part arrived


class Admission:
    """Runs `serve(request)` (which checks it and queues it for a worker) for each admitted request; refuses a
    malformed one with its status; closes one that misses its deadline ("deadline"), comes from an address over its cap
    or past the cap of all pending ones ("over_cap"), or meets an unexpected error ("error": logged, that connection
    closed, the loop goes on), telling `closed(reason)`. A failed accept() pauses accepting (_pause_accepting)."""

    def __init__(self, listener: socket.socket, serve: Callable[[Request], None], *, tls: ssl.SSLContext | None,
                 deadline_s: float = ADMISSION_S, per_peer: int = MAX_PENDING_PER_PEER,
                 max_pending: int | None = None, closed: Callable[[str], None] = lambda reason: None) -> None:
        self.listener = listener
        self.serve = serve
        self.tls = tls
        self.deadline_s = deadline_s
        self.per_peer = per_peer
        self.max_pending = pending_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0]) if max_pending is None else max_pending
        self.closed = closed
        self._pending: dict[socket.socket, _Pending] = {}
        self._per_host: Counter[str] = Counter()
        self._selector = selectors.DefaultSelector()
        self.accept_failures = 0  # accept() calls that failed (all told)
        self._backoff_s = 0.0  # the current pause after failed accepts; 0 while they succeed
        self._resume_at: float | None = None  # while paused, when the listener is watched again
        self._in_row = 0
        self._failures_unlogged = 0
        self._next_log = 0.0

    def run(self, stop: threading.Event) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        try:
            while not stop.is_set():
                if self._resume_at is not None and time.monotonic() >= self._resume_at:
                    self._resume_at = None
                    self._selector.register(self.listener, selectors.EVENT_READ)
                timeout = POLL_S
                if self._pending:
                    timeout = min(timeout, min(p.deadline for p in self._pending.values()) - time.monotonic())
                if self._resume_at is not None:
                    timeout = min(timeout, self._resume_at - time.monotonic())
                timeout = max(0.0, timeout)
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif (pending := self._pending.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._advance_or_drop(pending)
                self._cut_off_late()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst, then the pending ones get their turn
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: a later accept may work
                self._pause_accepting(exc)
                return
            if self._in_row:
                log.info("data plane: accepting again after %d failed accept(s) in a row", self._in_row)
                self._backoff_s, self._in_row, self._failures_unlogged, self._next_log = 0.0, 0, 0, 0.0
            self._admit(sock, peer)

    def _pause_accepting(self, exc: OSError) -> None:
        """Leave the listener alone for a while (it stays readable: the connection that could not be accepted waits in
        the backlog), doubling the pause at each failure in a row; log at most once per ACCEPT_BACKOFF_MAX_S."""
        self.accept_failures += 1
        self._in_row += 1
        self._failures_unlogged += 1
        self._backoff_s = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_MIN_S, 2 * self._backoff_s))
        now = time.monotonic()
        self._resume_at = now + self._backoff_s
        self._selector.unregister(self.listener)
        if now >= self._next_log:
            log.warning("data plane: accept failed (%s); %d failed accept(s) since the last report, next try in %.2fs",
                        exc, self._failures_unlogged, self._backoff_s)
            self._failures_unlogged = 0
            self._next_log = now + ACCEPT_BACKOFF_MAX_S

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        host = host_of(peer)
        if self._per_host[host] >= self.per_peer or len(self._pending) >= self.max_pending:
            self.closed("over_cap")
            sock.close()
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            self._selector.register(sock, selectors.EVENT_READ)
        except Exception as exc:  # e.g. a reset before the wrap, an ssl error: this connection only
            self._failed(peer, exc)
            sock.close()
            return
        pending = _Pending(sock, peer, time.monotonic() + self.deadline_s, handshaking=self.tls is not None)
        self._pending[sock] = pending
        self._per_host[host] += 1
        self._advance_or_drop(pending)

    def _advance_or_drop(self, pending: _Pending) -> None:
        try:
            self._advance(pending)
        except Exception as exc:  # anything _advance does not expect (serve() included): close this one, go on
            self._failed(pending.peer, exc)
            self._drop(pending)

    def _failed(self, peer: Any, exc: Exception) -> None:
        log.warning("data plane: connection from %s closed after an unexpected error in admission: %r", peer, exc, exc_info=exc)
        self.closed("error")

    def _advance(self, pending: _Pending) -> None:
        """As far as the bytes that arrived allow: the handshake, the request's fixed part, its header."""
        try:
            if pending.handshaking:
                pending.sock.do_handshake()  # type: ignore[attr-defined]
                pending.handshaking = False
            while len(pending.got) < pending.need:
                data = pending.sock.recv(pending.need - len(pending.got))
                if not data:
                    raise ConnectionError("closed before its request was whole")
                pending.got += data
                if pending.head is None and len(pending.got) == wire.REQUEST_BYTES:
                    pending.head = wire.parse_request(bytes(pending.got))
                    pending.need += pending.head[2]
        except ssl.SSLWantWriteError:
            self._selector.modify(pending.sock, selectors.EVENT_WRITE)
            return
        except (ssl.SSLWantReadError, BlockingIOError):
            self._selector.modify(pending.sock, selectors.EVENT_READ)
            return
        except WireError as exc:
            self._refuse(pending, exc)
            return
        except (OSError, ssl.SSLError) as exc:  # a failed handshake, a reset, an early close
            log.info("data plane: connection from %s dropped before its request: %s", pending.peer, exc)
            self._drop(pending)
            return
        assert pending.head is not None
        op, ticket, _ = pending.head
        self._release(pending)
        pending.sock.setblocking(True)
        self.serve(Request(pending.sock, pending.peer, op, ticket, bytes(pending.got[wire.REQUEST_BYTES :])))

    def _cut_off_late(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self.closed("deadline")
            stage = "TLS handshake" if pending.handshaking else f"request ({len(pending.got)} of {pending.need} bytes)"
            log.info("data plane: %s cut off: no whole %s within %.1fs", pending.peer, stage, self.deadline_s)
            self._drop(pending)

    def _refuse(self, pending: _Pending, exc: WireError) -> None:
        log.warning("data plane: refused (INVALID_ARGUMENT): %s", exc)
        self._release(pending)
        try:
            pending.sock.settimeout(self.deadline_s)  # a few bytes into an empty send buffer: never waits in practice
            wire.send_status(pending.sock, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (OSError, ssl.SSLError):
            pass
        pending.sock.close()

    def _drop(self, pending: _Pending) -> None:
        self._release(pending)
        try:
            pending.sock.close()
        except OSError:
            pass

    def _release(self, pending: _Pending) -> None:
        if self._pending.pop(pending.sock, None) is None:
            return
        self._selector.unregister(pending.sock)
        host = host_of(pending.peer)
        self._per_host[host] -= 1
        if not self._per_host[host]:
            del self._per_host[host]


class TransferQueue:
    """Admitted requests waiting for a transfer worker, first come first served. Bounded: at most `limit` wait, at most
    `per_peer` of one address (`put` refuses more UNAVAILABLE at once: "queue_full"), and each waits at most `wait_s`:
    one still waiting then is refused UNAVAILABLE and closed ("queue_deadline"), by the queue's own thread, so the wait
    has its deadline even while every worker is busy. `closed(reason)` counts both."""

    def __init__(self, *, wait_s: float = QUEUE_WAIT_S, limit: int = MAX_QUEUED, per_peer: int = MAX_QUEUED_PER_PEER,
                 closed: Callable[[str], None] = lambda reason: None) -> None:
        self.wait_s = wait_s
        self.limit = limit
        self.per_peer = per_peer
        self.closed = closed
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, Request]] = deque()  # (deadline, request): one wait_s for all, so in deadline order
        self._per_host: Counter[str] = Counter()
        self._stopped = False
        threading.Thread(target=self._expire, name="data-plane-queue-deadlines", daemon=True).start()

    def put(self, request: Request) -> bool:
        """Queue the request, or refuse it (UNAVAILABLE, naming the cap) and say so."""
        host = host_of(request.peer)
        with self._cond:
            if self._stopped:
                reason = "the data plane is stopping"
            elif len(self._queue) >= self.limit:
                reason = f"{self.limit} transfers already wait for a worker"
            elif self._per_host[host] >= self.per_peer:
                reason = f"{self.per_peer} transfers from {host} already wait for a worker"
            else:
                self._queue.append((time.monotonic() + self.wait_s, request))
                self._per_host[host] += 1
                self._cond.notify_all()
                return True
        self.closed("queue_full")
        log.warning("data plane: %s refused (UNAVAILABLE): %s", request.peer, reason)
        refuse(request.conn, grpc.StatusCode.UNAVAILABLE, f"data plane busy: {reason}; retry")
        return False

    def take(self) -> Request | None:
        """The oldest waiting request, once there is one (for a worker); None once stopped."""
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            return self._pop()

    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self) -> None:
        """Take no more; refuse those waiting (UNAVAILABLE); idle workers' take() returns None."""
        with self._cond:
            self._stopped = True
            left = [self._pop() for _ in range(len(self._queue))]
            self._cond.notify_all()
        for request in left:
            refuse(request.conn, grpc.StatusCode.UNAVAILABLE, "the data plane is stopping")

    def _pop(self) -> Request:
        _, request = self._queue.popleft()
        host = host_of(request.peer)
        self._per_host[host] -= 1
        if not self._per_host[host]:
            del self._per_host[host]
        return request

    def _expire(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._cond.wait(self._queue[0][0] - time.monotonic() if self._queue else None)
                if self._stopped:
                    return
                now = time.monotonic()
                late = [self._pop() for _ in range(sum(1 for deadline, _ in self._queue if deadline <= now))]
            for request in late:
                self.closed("queue_deadline")
                log.warning("data plane: %s's request waited %.1fs for a worker: refused (UNAVAILABLE)", request.peer,
                            self.wait_s)
                refuse(request.conn, grpc.StatusCode.UNAVAILABLE,
                       f"waited {self.wait_s:g}s for a transfer worker (all busy); retry")
