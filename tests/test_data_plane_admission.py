"""The data plane's front door: a peer that idles or trickles is cut off at its admission deadline without holding the
one worker, a legitimate request gets through meanwhile, and one address cannot hold more than its cap."""

from __future__ import annotations

import resource
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from coordinator.data_plane_admission import Admission, Request, pending_cap
from deploy.provision import provision
from fedsynth.wire.tls import TLSFiles, ssl_client_context, ssl_server_context
from fedsynth.wire import data_plane as wire

ATTACKER = "127.0.0.2"  # another loopback address: the cap is per address
GENEROUS_S = 20.0


def open_front_door(tls: ssl.SSLContext | None = None) -> Iterator[tuple[int, Counter[str], list[bytes]]]:
    served: list[bytes] = []
    pool = ThreadPoolExecutor(1)

    def serve(request: Request) -> None:
        with request.conn:
            served.append(request.ticket)
            wire.send_status(request.conn, grpc.StatusCode.OK, request.ticket.hex())

    stage = open_front_door_serving(lambda request: pool.submit(serve, request), tls)
    try:
        port, closed, _ = next(stage)
        yield port, closed, served
    finally:
        stage.close()  # stops admission before the pool it submits to
        pool.shutdown(wait=True)


@pytest.fixture
def front_door() -> Iterator[tuple[int, Counter[str], list[bytes]]]:
    """An admission stage with a 0.5 s deadline and a cap of 4 per address before ONE worker, which answers OK with
    the request's ticket; (port, closed connections by reason, tickets served)."""
    yield from open_front_door()


def request_bytes(ticket: bytes) -> bytes:
    return struct.pack("<4sB16sI", wire.MAGIC, wire.FETCH, ticket, 0)


def legitimate_fetch(port: int, ticket: bytes) -> tuple[grpc.StatusCode, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
        sock.sendall(request_bytes(ticket))
        return wire.read_status(sock)


def trickler(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S, source_address=(ATTACKER, 0))


def cut_off(sock: socket.socket, payload: bytes) -> bool:
    """Trickle `payload` a byte at a time (0.1 s apart) until the server closes the connection; whether it did before
    the whole payload went (it never gets a reply: its request is never whole in time)."""
    for byte in payload:
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # reset: closed by the server
            return True
        time.sleep(0.1)
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_a_trickling_peer_is_cut_off_and_does_not_block_a_legitimate_transfer(front_door: tuple[int, Counter[str], list[bytes]]) -> None:
    port, closed, served = front_door
    peers = [trickler(port) for _ in range(3)]
    results: list[bool] = []
    threads = [threading.Thread(target=lambda s=s: results.append(cut_off(s, request_bytes(b"x" * 16)))) for s in peers]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the tricklers are in, holding whatever they can
    assert legitimate_fetch(port, b"L" * 16) == (grpc.StatusCode.OK, (b"L" * 16).hex())
    for thread in threads:
        thread.join(timeout=GENEROUS_S)
    assert results == [True, True, True]
    assert closed["deadline"] == 3 and served == [b"L" * 16]
    for sock in peers:
        sock.close()


def test_a_peer_that_never_sends_is_cut_off(front_door: tuple[int, Counter[str], list[bytes]]) -> None:
    port, closed, _ = front_door
    with trickler(port) as idle:
        assert idle.recv(1) == b""  # closed by the server, long before the generous timeout
    assert closed["deadline"] == 1


def test_connections_past_the_cap_of_one_address_are_closed_and_others_still_served(
    front_door: tuple[int, Counter[str], list[bytes]],
) -> None:
    port, closed, served = front_door
    held = [trickler(port) for _ in range(4)]
    time.sleep(0.1)
    with trickler(port) as extra:
        assert extra.recv(1) == b""
    assert closed["over_cap"] >= 1
    assert legitimate_fetch(port, b"M" * 16)[0] == grpc.StatusCode.OK and served == [b"M" * 16]
    for sock in held:
        sock.close()


def test_a_malformed_request_is_refused_with_its_reason_and_never_reaches_a_worker(
    front_door: tuple[int, Counter[str], list[bytes]],
) -> None:
    port, _, served = front_door
    with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 16)
        code, message = wire.read_status(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a fedsynth data-plane request" in message
    assert served == []


def test_with_mutual_tls_a_handshake_that_never_comes_is_cut_off_and_a_client_gets_through(tmp_path: Path) -> None:
    provision(tmp_path, 1)
    server = ssl_server_context(TLSFiles.from_dir(tmp_path, "coordinator"))
    client = ssl_client_context(TLSFiles.from_dir(tmp_path, "client-0"))
    front_door = open_front_door(server)
    port, closed, served = next(front_door)
    try:
        with trickler(port) as silent:  # TCP only: no ClientHello ever comes
            with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as raw:
                with client.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                    sock.sendall(request_bytes(b"T" * 16))
                    assert wire.read_status(sock) == (grpc.StatusCode.OK, (b"T" * 16).hex())
            assert silent.recv(1) == b""
        assert closed["deadline"] == 1 and served == [b"T" * 16]
    finally:
        front_door.close()


def open_front_door_serving(serve: Callable[[Request], None], tls: ssl.SSLContext | None = None,
                            max_pending: int | None = None) -> Iterator[tuple[int, Counter[str], threading.Thread]]:
    """An admission stage that calls `serve` itself (no pool); (port, closed connections by reason, its thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed: Counter[str] = Counter()
    admission = Admission(listener, serve, tls=tls, deadline_s=0.5, per_peer=4, max_pending=max_pending,
                          closed=lambda reason: closed.update([reason]))
    stop = threading.Event()
    thread = threading.Thread(target=admission.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], closed, thread
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def answer(request: Request) -> None:
    """Answers OK with the ticket, unless the ticket is b"!" * 16: then fails as a worker pool that was shut down does."""
    if request.ticket == b"!" * 16:
        raise RuntimeError("cannot schedule new futures after shutdown")
    with request.conn:
        wire.send_status(request.conn, grpc.StatusCode.OK, request.ticket.hex())


def test_an_unexpected_error_with_one_connection_closes_it_counts_it_and_admission_goes_on() -> None:
    front_door = open_front_door_serving(answer)
    port, closed, thread = next(front_door)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
            sock.sendall(request_bytes(b"!" * 16))
            assert sock.recv(1) == b""  # closed, not left hanging
        assert closed["error"] == 1 and thread.is_alive()
        assert legitimate_fetch(port, b"A" * 16) == (grpc.StatusCode.OK, (b"A" * 16).hex())
    finally:
        front_door.close()


class BrokenOnce(ssl.SSLContext):
    """A server TLS context whose first wrap_socket fails as an ssl error would (a fault of that one connection)."""

    failed = False

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        if not BrokenOnce.failed:
            BrokenOnce.failed = True
            raise ssl.SSLError("simulated failure in wrap_socket")
        return super().wrap_socket(*args, **kwargs)


def test_a_connection_whose_tls_wrap_fails_is_closed_and_the_next_one_is_served(tmp_path: Path) -> None:
    provision(tmp_path, 1)
    files = TLSFiles.from_dir(tmp_path, "coordinator")
    server = BrokenOnce(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(files.cert), str(files.key))
    server.load_verify_locations(str(files.ca))
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl_client_context(TLSFiles.from_dir(tmp_path, "client-0"))
    front_door = open_front_door_serving(answer, server)
    port, closed, thread = next(front_door)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as raw:
            with pytest.raises((OSError, ssl.SSLError)):
                with client.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                    sock.sendall(request_bytes(b"B" * 16))
                    wire.read_status(sock)
        assert closed["error"] == 1 and thread.is_alive()
        with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as raw:
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(request_bytes(b"C" * 16))
                assert wire.read_status(sock) == (grpc.StatusCode.OK, (b"C" * 16).hex())
    finally:
        front_door.close()


def test_past_the_cap_of_all_pending_connections_more_are_closed() -> None:
    front_door = open_front_door_serving(answer, max_pending=2)
    port, closed, _ = next(front_door)
    try:
        held = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{3 + i}", 0)) for i in range(2)]
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S, source_address=("127.0.0.9", 0)) as extra:
            assert extra.recv(1) == b""
        assert closed["over_cap"] == 1
        for sock in held:
            sock.close()
    finally:
        front_door.close()


@pytest.mark.parametrize("soft, cap", [(1024, 512), (256, 128), (1 << 20, 4096), (resource.RLIM_INFINITY, 4096), (1, 1)])
def test_the_cap_of_all_pending_connections_leaves_half_the_descriptor_limit_free(soft: int, cap: int) -> None:
    assert pending_cap(soft) == cap
