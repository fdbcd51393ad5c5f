"""The coordinator's data plane (runtime.data_plane = "tcp"): serves task payloads and receives updates as raw bytes,
one connection per transfer; the protocol and why are in fedsynth/wire/data_plane.py.

Every check of the gRPC path holds: an update goes through Federation.accept_update (the open round, the receive slot,
the digest, keys, shapes, dtypes, finiteness) and a refusal carries the status code gRPC would give. A connection
reaches a worker (one of MAX_TRANSFERS) only once its TLS handshake and request header are whole, within a second
(coordinator.data_plane_admission), and its certificate (not revoked) and its ticket (of the open round, the
certificate's client's) have been checked there: a refused request never waits. It then waits in a bounded queue, at
most QUEUE_WAIT_S; from then on each read and send has a stall deadline (the run's heartbeat timeout: no byte moved
for that long), a whole payload, either way, the round's deadline, and a ticket serves one transfer at a time. Should
the admission loop die, the data plane tells `on_dead` (the server turns its gRPC health NOT_SERVING).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import grpc
import torch

from coordinator.data_plane_admission import QUEUE_WAIT_S, Admission, Request, TransferQueue, refuse
from coordinator.federation import Federation
from coordinator.receive_slots import SLOTTED_UPLOAD_BYTES, ReceiveSlots, UploadCancelled
from coordinator.updates import header_fields
from fedsynth.wire import data_plane as wire
from fedsynth.errors import FedsynthError, StateError, WireError
from fedsynth.wire.tensor_buffer import ReceiveBuffers
from fedsynth.wire.tls import AuthenticationError, RevocationList, identity_of_der
from fedsynth.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)
ACCEPT_POLL_S = 0.25  # how soon the admission loop notices stop()
MAX_TRANSFERS = 32  # requests served at once; more wait in the TransferQueue (uploads also wait for a receive slot)


class TicketInUse(FedsynthError):
    """A second transfer on a ticket whose first is still under way: UNAVAILABLE (the client retries once it ends)."""


class DataPlaneServer:
    def __init__(self, federation: Federation, receive_slots: ReceiveSlots, *, host: str, port: int = 0,
                 tls: ssl.SSLContext | None = None, revoked: RevocationList | None = None,
                 receive_buffers: ReceiveBuffers | None = None, workers: int = MAX_TRANSFERS,
                 queue_wait_s: float = QUEUE_WAIT_S, on_dead: Callable[[], None] | None = None) -> None:
        self.federation = federation
        self.receive_slots = receive_slots
        self.receive_buffers = receive_buffers
        self.tls = tls
        self.revoked = revoked
        # a stalled peer (no byte for this long) is dropped: the time after which a silent client counts as gone
        self.stall_s = federation.cfg.runtime.heartbeat_timeout_s
        self.listener = socket.create_server((host, port), family=socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0],
                                             backlog=128)
        self.port: int = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._tickets_in_use: set[bytes] = set()
        self._tickets_lock = threading.Lock()
        self.on_dead = on_dead  # called (once) if the admission loop dies: the server's health goes NOT_SERVING
        self.dead = False
        closed = federation.metrics.data_plane_closed
        count = lambda reason: closed.labels(reason=reason).inc()  # noqa: E731
        self.queue = TransferQueue(wait_s=queue_wait_s, closed=count)
        self.admission = Admission(self.listener, self._check_and_queue, tls=tls, closed=count)
        self._thread = threading.Thread(target=self._admit_until_stopped, name="data-plane-admission", daemon=True)
        self._workers = [threading.Thread(target=self._work, name=f"data-plane-{i}", daemon=True) for i in range(workers)]

    def start(self) -> None:
        for worker in self._workers:
            worker.start()
        self._thread.start()
        log.info("data plane on port %d (%s)", self.port, "mutual TLS" if self.tls is not None else "plaintext")

    def stop(self) -> None:
        """No new transfers, none waiting (refused UNAVAILABLE); one under way ends at its next stall deadline, or with
        the process."""
        self._stop.set()
        self._thread.join(timeout=ACCEPT_POLL_S * 4)
        self.listener.close()
        self.queue.stop()

    def _admit_until_stopped(self) -> None:
        try:
            self.admission.run(self._stop)
        except Exception:  # a bug: no new transfer can start, so the coordinator must stop saying it serves
            log.critical("data plane: the admission loop died; no new transfers on port %d, health NOT_SERVING", self.port,
                         exc_info=True)
            self.dead = True
            self.listener.close()  # clients are refused at connect (UNAVAILABLE) instead of waiting in the backlog
            self.queue.stop()
            if self.on_dead is not None:
                self.on_dead()

    def _work(self) -> None:
        while (request := self.queue.take()) is not None:
            self._serve(request)

    # ---- admission: before the queue ------------------------------------------------------------------------------

    def _check_and_queue(self, request: Request) -> None:
        """On the admission thread: the certificate (a client's, not revoked) and the ticket (of the open round, issued
        to that client) before the request may wait for a worker; a refused one gets its status at once. The worker
        checks again (the round may close meanwhile)."""
        try:
            caller = self._caller(request.conn)
            client_id, _, _ = self.federation.data_plane_client(request.ticket, task=False)
            self._check_caller(client_id, caller)
        except (AuthenticationError, StateError) as exc:
            code = self._refused(request.op, exc)
            refuse(request.conn, code, str(exc))
            return
        self.queue.put(request)

    # ---- one connection ------------------------------------------------------------------------------------------

    def _serve(self, request: Request) -> None:
        try:
            with request.conn as conn:  # closed however the transfer ends
                conn.settimeout(self.stall_s)
                self._answer(conn, request)
        except (OSError, ssl.SSLError, WireError) as exc:  # the peer vanished, stalled or spoke garbage mid-transfer
            log.warning("data plane: transfer with %s broke off: %s", request.peer, exc)
        except Exception:  # a bug: log it, never take the listener down with it
            log.exception("data plane: transfer with %s failed", request.peer)

    def _answer(self, conn: socket.socket, request: Request) -> None:
        op, ticket, header = request.op, request.ticket, request.header
        try:
            with self._one_transfer(ticket):
                caller = self._caller(conn)
                if op == wire.FETCH:
                    self._fetch(conn, ticket, caller)
                else:
                    self._submit(conn, ticket, header, caller)
        except (UploadCancelled, AuthenticationError, WireError, ValueError, StateError, TicketInUse) as exc:
            code = self._refused(op, exc)
            try:
                wire.send_status(conn, code, str(exc))
            except OSError:
                pass  # the peer is gone already

    def _refused(self, op: int, exc: Exception) -> grpc.StatusCode:
        """Log and count a refusal; its status code."""
        code = _status_of(exc)
        log.warning("data plane: refused (%s): %s", code.name, exc)
        if op == wire.SUBMIT:
            self.federation.metrics.rejected_updates.labels(code=code.name).inc()
        return code

    @contextmanager
    def _one_transfer(self, ticket: bytes) -> Iterator[None]:
        """Holds the ticket for one transfer: a client fetches, then submits, never both at once, so a second
        connection on a ticket in use is refused rather than given another worker."""
        with self._tickets_lock:
            if ticket in self._tickets_in_use:
                raise TicketInUse("this data-plane ticket is in use by another transfer (one at a time per ticket); "
                                  "retry once it ends")
            self._tickets_in_use.add(ticket)
        try:
            yield
        finally:
            with self._tickets_lock:
                self._tickets_in_use.discard(ticket)

    def _caller(self, conn: socket.socket) -> int | None:
        """With mutual TLS, the client id of the certificate (not revoked); None in plaintext, where the ticket alone
        names the caller."""
        if self.tls is None:
            return None
        identity = identity_of_der(conn.getpeercert(binary_form=True))  # type: ignore[attr-defined]
        reason = self.revoked.reason(identity) if self.revoked is not None else None
        if reason is not None:
            raise AuthenticationError(reason)
        if identity.client_id is None:
            raise AuthenticationError(f"{identity.node_id} is not a client: the data plane serves clients only")
        return identity.client_id

    @staticmethod
    def _check_caller(client_id: int, caller: int | None) -> None:
        if caller is not None and caller != client_id:
            raise AuthenticationError(f"client-{caller} presented client {client_id}'s data-plane ticket")

    def _fetch(self, conn: socket.socket, ticket: bytes, caller: int | None) -> None:
        client_id, rnd, delivery = self.federation.data_plane_client(ticket, task=True)
        assert delivery is not None
        self._check_caller(client_id, caller)
        payload = delivery.payload
        if payload.buffer is None:
            raise StateError(f"round {delivery.round}'s payload does not travel on the data plane")
        wire.send_status(conn, grpc.StatusCode.OK)
        try:
            wire.send_payload(conn, payload.buffer, payload.digest, with_size=True, deadline=rnd.started + rnd.deadline_s)
        except WireError as exc:  # mid-payload: no status can follow; the client sees the bytes end and reconnects
            log.warning("data plane: round %d's payload to client %d cut off: %s", delivery.round, client_id, exc)
            return
        self.federation.mark_delivered(client_id, delivery.task_id, payload.meta.total_bytes)

    def _submit(self, conn: socket.socket, ticket: bytes, raw_header: bytes, caller: int | None) -> None:
        client_id, rnd, _ = self.federation.data_plane_client(ticket, task=False)
        self._check_caller(client_id, caller)
        try:
            h = pb.UpdateHeader.FromString(raw_header)
        except Exception as exc:  # protobuf's DecodeError: bytes that are no UpdateHeader
            raise WireError(f"the request header is not an UpdateHeader ({type(exc).__name__})") from None
        if h.inline_payload:
            raise WireError("an update on the data plane sends its bytes after the header, not inline in it")
        if h.client_id != client_id or h.task_id != rnd.task_id:
            raise AuthenticationError(f"the update names client {h.client_id} and task {h.task_id[:8]!r}, but the ticket is "
                                      f"client {client_id}'s for task {rnd.task_id[:8]!r}")
        header = header_fields(h)
        total = header["total_bytes"]

        def receive(max_bytes: int) -> torch.Tensor:
            if total > max_bytes:
                raise WireError(f"announced payload of {total} bytes exceeds the limit of {max_bytes}")
            wire.send_status(conn, grpc.StatusCode.OK)  # go: the header fits the round and a slot is held
            return wire.receive_payload(conn, total, deadline=rnd.started + rnd.deadline_s, buffers=self.receive_buffers)

        def receiving() -> Any:
            if total < SLOTTED_UPLOAD_BYTES:
                return nullcontext(True)
            return self.receive_slots.hold(lambda: not self._stop.is_set(), what=f"client {client_id}'s update for round {h.round}")

        self.federation.accept_update(header, receive, receiving=receiving)
        wire.send_status(conn, grpc.StatusCode.OK)


def _status_of(exc: Exception) -> grpc.StatusCode:
    """The code the gRPC servicer gives the same refusal."""
    if isinstance(exc, UploadCancelled):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, TicketInUse):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, StateError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT  # WireError, and ValueError from the aggregator's layout checks
