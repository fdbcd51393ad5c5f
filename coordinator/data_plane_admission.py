"""The data plane's front door: one thread accepts connections, completes each TLS handshake and reads each request
header without blocking, under one deadline per connection and a cap per peer address. Only a whole, well-formed
request reaches a worker, so a peer that connects and idles or trickles never holds one.

Why not a deadline per read in the workers: 48 connections that each sent one byte every 4 s held all 32 workers
(each read met its 6 s deadline) and stalled a round for as long as they kept at it (docs/runtime.md).
"""

from __future__ import annotations

import logging
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
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


def pending_cap(soft_nofile: int) -> int:
    """How many connections may be in admission at once, from the process's soft RLIMIT_NOFILE: half of it, so the
    other half stays for the gRPC server's connections, the transfer workers', files and checkpoints (1,024, the common
    soft limit, gives 512); RLIM_INFINITY gives the ceiling."""
    if soft_nofile == resource.RLIM_INFINITY or soft_nofile < 0:
        return MAX_PENDING_CEILING
    return max(1, min(MAX_PENDING_CEILING, soft_nofile // 2))


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
    """Runs `serve(request)` (which hands it to a pool) for each admitted request; refuses a malformed one with its
    status; closes one that misses its deadline ("deadline"), comes from an address over its cap or past the cap of
    all pending ones ("over_cap"), or meets an unexpected error ("error": logged, that connection closed, the loop goes
    on), telling `closed(reason)`."""

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

    def run(self, stop: threading.Event) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        try:
            while not stop.is_set():
                timeout = POLL_S
                if self._pending:
                    timeout = max(0.0, min(timeout, min(p.deadline for p in self._pending.values()) - time.monotonic()))
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
            except OSError as exc:  # e.g. out of file descriptors: the next accept may work
                log.warning("data plane: accept failed: %s", exc)
                return
            self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        host = peer[0] if isinstance(peer, tuple) else str(peer)
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
        host = pending.peer[0] if isinstance(pending.peer, tuple) else str(pending.peer)
        self._per_host[host] -= 1
        if not self._per_host[host]:
            del self._per_host[host]
