"""The data plane's guards beside admission (issue 46, "same guards on every port"), on real sockets on port 0: the
queue of admitted requests is bounded in all and per address and each wait has a deadline; a refused ticket or a
revoked certificate is refused at admission, never queued; accept() failing (out of file descriptors) backs off
instead of spinning; a send fails only when no byte moved for its stall timeout, so a slow reader still gets the
whole payload; and a dead admission loop turns the coordinator's gRPC health NOT_SERVING."""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from coordinator.data_plane import DataPlaneServer
from coordinator.data_plane_admission import Admission, Request, TransferQueue
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import CoordinatorServer, create_server
from coordinator.servicer import SERVICE_NAME
from deploy.provision import provision
from fedsynth.wire import data_plane as wire
from fedsynth.wire.tls import RevocationList, TLSFiles, ssl_client_context, ssl_server_context
from runtime_harness import channel, config, wait_until

GENEROUS_S = 20.0
TCP_RUN = {"data.clients": 1, "train.rounds": 1, "runtime.data_plane": "tcp", "runtime.data_plane_min_bytes": 0}


def fetch_request(ticket: bytes) -> bytes:
    return struct.pack("<4sB16sI", wire.MAGIC, wire.FETCH, ticket, 0)


# ---- the queue: bounded, per address, with a deadline ---------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock


def queued_request(listener: socket.socket, source: str) -> tuple[socket.socket, Request]:
    """A client connection from `source` and the server side of it as an admitted request (its client end, request)."""
    client = socket.create_connection(listener.getsockname(), timeout=GENEROUS_S, source_address=(source, 0))
    conn, peer = listener.accept()
    return client, Request(conn, peer, wire.FETCH, b"q" * 16, b"")


def test_the_queue_caps_one_address_below_the_whole_and_refuses_past_either_at_once(listener: socket.socket) -> None:
    closed: Counter[str] = Counter()
    queue = TransferQueue(wait_s=GENEROUS_S, limit=3, per_peer=2, closed=lambda reason: closed.update([reason]))
    clients: list[socket.socket] = []
    try:
        for _ in range(2):
            client, request = queued_request(listener, "127.0.0.2")
            clients.append(client)
            assert queue.put(request)
        client, request = queued_request(listener, "127.0.0.2")  # a third from the same address
        clients.append(client)
        assert not queue.put(request)
        assert wire.read_status(client) == (grpc.StatusCode.UNAVAILABLE,
                                            "data plane busy: 2 transfers from 127.0.0.2 already wait for a worker; retry")
        client, request = queued_request(listener, "127.0.0.3")  # another address still gets in
        clients.append(client)
        assert queue.put(request)
        client, request = queued_request(listener, "127.0.0.4")  # but not past the cap of all
        clients.append(client)
        assert not queue.put(request)
        code, message = wire.read_status(client)
        assert code == grpc.StatusCode.UNAVAILABLE and "3 transfers already wait for a worker" in message
        assert closed == {"queue_full": 2} and queue.waiting() == 3
        taken = queue.take()  # first come, first served: frees its address's place
        assert taken is not None and taken.peer[0] == "127.0.0.2"
        taken.conn.close()
        client, request = queued_request(listener, "127.0.0.2")
        clients.append(client)
        assert queue.put(request)
    finally:
        queue.stop()
        for client in clients:
            client.close()


def test_a_request_that_waits_past_its_deadline_is_refused_and_counted(
    listener: socket.socket, caplog: pytest.LogCaptureFixture,
) -> None:
    closed: Counter[str] = Counter()
    queue = TransferQueue(wait_s=0.3, closed=lambda reason: closed.update([reason]))  # no worker ever takes it
    client, request = queued_request(listener, "127.0.0.1")
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="coordinator.data_plane_admission"):
            assert queue.put(request)
            code, message = wire.read_status(client)
            assert client.recv(1) == b""  # and closed
        assert 0.25 <= time.monotonic() - started < 3.0
        assert code == grpc.StatusCode.UNAVAILABLE and message == "waited 0.3s for a transfer worker (all busy); retry"
        assert closed == {"queue_deadline": 1} and queue.waiting() == 0
        assert "waited 0.3s for a worker: refused (UNAVAILABLE)" in caplog.text
    finally:
        queue.stop()
        client.close()


# ---- accept() failing: a backoff, not a spin -----------------------------------------------------------------------


def test_accept_failing_with_emfile_backs_off_and_logs_rarely(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    calls = 0
    real_accept = socket.socket.accept

    def out_of_descriptors(self: socket.socket) -> Any:
        nonlocal calls
        calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    served: list[bytes] = []

    def serve(request: Request) -> None:
        with request.conn:
            served.append(request.ticket)
            wire.send_status(request.conn, grpc.StatusCode.OK)

    listener = socket.create_server(("127.0.0.1", 0))
    admission = Admission(listener, serve, tls=None)
    stop = threading.Event()
    thread = threading.Thread(target=admission.run, args=(stop,), daemon=True)
    monkeypatch.setattr(socket.socket, "accept", out_of_descriptors)
    try:
        with caplog.at_level(logging.WARNING, logger="coordinator.data_plane_admission"):
            thread.start()
            with socket.create_connection(listener.getsockname(), timeout=GENEROUS_S) as client:  # in the backlog
                client.sendall(fetch_request(b"E" * 16))
                time.sleep(1.0)
                # 10 ms doubling: tries at about 0, 10, 30, 70, 150, 310, 630 ms (a spin made ~70,000 in a second)
                assert 3 <= calls <= 10, calls
                lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
                assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # at most one a second
                assert "Too many open files" in lines[0].getMessage()
                monkeypatch.setattr(socket.socket, "accept", real_accept)  # descriptors free again
                assert wire.read_status(client) == (grpc.StatusCode.OK, "")  # accepted within the 1 s cap, then served
        assert served == [b"E" * 16] and admission.accept_failures == calls and thread.is_alive()
    finally:
        monkeypatch.setattr(socket.socket, "accept", real_accept)
        stop.set()
        thread.join(timeout=5)
        listener.close()


# ---- a send: a stall timeout, not one timeout for a whole piece -----------------------------------------------------


@pytest.fixture
def small_buffered_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection over loopback with small socket buffers (the kernel holds little of what is sent): (sender,
    reader), the sender's stall timeout 0.5 s."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited by the accepted socket
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        sender = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sender.connect(server.getsockname())
        reader, _ = server.accept()
    sender.settimeout(0.5)
    reader.settimeout(GENEROUS_S)
    with sender, reader:
        yield sender, reader


def test_a_reader_slower_than_a_piece_per_stall_timeout_still_gets_the_whole_payload(
    small_buffered_pair: tuple[socket.socket, socket.socket],
) -> None:
    """3 MB at ~1 MB/s with a 0.5 s stall timeout: one 4 MiB piece would need 8 MB/s under one timeout per piece."""
    sender, reader = small_buffered_pair
    payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    received = bytearray()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            wire.send_payload(sender, payload, with_size=True, deadline=time.monotonic() + GENEROUS_S)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=send)
    started = time.monotonic()
    thread.start()
    total = 8 + payload.numel() + wire.DIGEST_BYTES
    while len(received) < total:  # 16 KiB every 16 ms: ~1 MB/s
        data = reader.recv(min(16 << 10, total - len(received)))
        assert data, f"closed after {len(received)} bytes: {errors}"
        received += data
        time.sleep(0.016)
    thread.join(GENEROUS_S)
    elapsed = time.monotonic() - started
    assert not errors and 2.0 < elapsed < 15.0, (errors, elapsed)
    (size,) = struct.unpack("<Q", received[:8])
    assert size == payload.numel() and bytes(received[8 : 8 + size]) == bytes(payload.numpy())
    assert received[8 + size :] == wire.digest_of(bytes(payload.numpy()))


def test_a_reader_that_stops_reading_is_cut_off_after_the_stall_timeout(
    small_buffered_pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, reader = small_buffered_pair
    payload = torch.zeros(8 << 20, dtype=torch.uint8)
    # the reader never reads: the buffers fill, then nothing moves
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the peer took no byte for 0\.5s \(\d+ of 8388608 bytes of the payload sent\)"):
        wire.send_payload(sender, payload, deadline=time.monotonic() + GENEROUS_S)
    assert time.monotonic() - started < 3.0
    assert sender.gettimeout() == 0.5  # its own timeout, back


# ---- a real coordinator: checks at admission, and its health when admission dies -----------------------------------


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorServer]:
    """create_server in-process with the data plane on; no round runs, so no ticket is valid."""
    root = tmp_path_factory.mktemp("guards")
    server, _ = create_server(config(TCP_RUN), out_dir=root / "run", port=0, metrics=CoordinatorMetrics(CollectorRegistry()))
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)


def no_worker_plane(coordinator: CoordinatorServer, **kwargs: Any) -> DataPlaneServer:
    """A second data plane on the coordinator's federation with no worker at all: whatever is queued is never served,
    so an answer within the queue's 20 s wait came from admission."""
    assert coordinator.data_plane is not None
    plane = DataPlaneServer(coordinator.federation, coordinator.data_plane.receive_slots, host="127.0.0.1", workers=0,
                            queue_wait_s=GENEROUS_S, **kwargs)
    plane.start()
    return plane


def test_an_unknown_ticket_is_refused_at_admission_without_waiting_for_a_worker(coordinator: CoordinatorServer) -> None:
    plane = no_worker_plane(coordinator)
    try:
        with pytest.raises(wire.DataPlaneError) as refused:
            wire.fetch(wire.Endpoint("127.0.0.1", plane.port), b"\x01" * 16, timeout_s=5.0)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown data-plane ticket" in refused.value.details()
        assert plane.queue.waiting() == 0
    finally:
        plane.stop()


def test_a_revoked_certificate_is_refused_at_admission(coordinator: CoordinatorServer, tmp_path: Path) -> None:
    provision(tmp_path, 1)
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("client-0\n")
    plane = no_worker_plane(coordinator, tls=ssl_server_context(TLSFiles.from_dir(tmp_path, "coordinator")),
                            revoked=RevocationList(revoked))
    try:
        endpoint = wire.Endpoint("127.0.0.1", plane.port, ssl_client_context(TLSFiles.from_dir(tmp_path, "client-0")))
        with pytest.raises(wire.DataPlaneError) as refused:
            wire.fetch(endpoint, b"\x01" * 16, timeout_s=5.0)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "revoked" in refused.value.details()
        assert plane.queue.waiting() == 0
    finally:
        plane.stop()


def test_a_dead_admission_loop_turns_health_not_serving(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    coordinator, port = create_server(config(TCP_RUN), out_dir=tmp_path / "run", port=0,  # its own: this test breaks it
                                      metrics=CoordinatorMetrics(CollectorRegistry()))
    try:
        plane = coordinator.data_plane
        assert plane is not None
        with channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=GENEROUS_S).status

            assert status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
            with caplog.at_level(logging.CRITICAL, logger="coordinator.data_plane"):
                plane.admission._selector.close()  # the loop's next select() raises: a fault no connection caused
                wait_until(lambda: plane.dead, timeout_s=5, what="the admission loop's death")
            assert status(SERVICE_NAME) == status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert "the admission loop died" in caplog.text
        with pytest.raises(wire.DataPlaneError) as refused:  # refused at connect, not left in a backlog nobody accepts
            wire.fetch(wire.Endpoint("127.0.0.1", plane.port), b"\x01" * 16, timeout_s=5.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        coordinator.stop(grace_s=0.5)
