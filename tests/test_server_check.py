"""A client node behind a dns:/// coordinator name that resolves to several addresses checks the certificate of every
one of them against its revocation list, at (re)connection and again before each task."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client_node.metrics import ClientMetrics
from client_node.node import LogicalClient, NodeOptions
from deploy.provision import provision
from fedsynth.wire import data_plane
from fedsynth.wire.server_check import RevokedServer
from fedsynth.wire.tls import RevocationList, TLSFiles, ssl_server_context
from prometheus_client import CollectorRegistry

NAME = "coordinator.test"  # resolved (in this test only) to two loopback addresses


def tls_server(host: str, port: int, context: ssl.SSLContext, stop: threading.Event) -> tuple[int, threading.Thread]:
    """A TLS server that completes each handshake (presenting `context`'s certificate) and closes."""
    listener = socket.create_server((host, port))
    listener.settimeout(0.2)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(5)
                try:
                    with context.wrap_socket(conn, server_side=True):
                        pass
                except (OSError, ssl.SSLError):
                    conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


@pytest.fixture
def two_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, int]]:
    """NAME:port resolves to 127.0.0.1 (the coordinator's certificate) and 127.0.0.2 (the generator's, also valid for
    NAME: another node answering for the coordinator's name)."""
    pki = tmp_path / "tls"
    provision(pki, 1, coordinator_hosts=NAME, generator_hosts=NAME)
    stop = threading.Event()
    port, first = tls_server("127.0.0.1", 0, ssl_server_context(TLSFiles.from_dir(pki, "coordinator")), stop)
    _, second = tls_server("127.0.0.2", port, ssl_server_context(TLSFiles.from_dir(pki, "generator")), stop)
    resolve = socket.getaddrinfo

    def two_addresses(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != NAME:
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in ("127.0.0.1", "127.0.0.2")]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    yield pki, port
    stop.set()
    first.join(timeout=5)
    second.join(timeout=5)


def client(pki: Path, port: int, revoked: Path) -> LogicalClient:
    options = NodeOptions(coordinator=f"dns:///{NAME}:{port}", generator=None, cache_dir=pki / "cache",
                          tls_files=TLSFiles.from_dir(pki, "client-0"), revoked=RevocationList(revoked))
    return LogicalClient(0, options, ClientMetrics(CollectorRegistry()), threading.Event())


def test_every_address_of_a_dns_name_is_checked_at_connection(two_servers: tuple[Path, int], tmp_path: Path) -> None:
    pki, port = two_servers
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("generator\n")
    with pytest.raises(RevokedServer, match=f"refusing the coordinator at 127.0.0.2:{port}: .*node generator is revoked"):
        client(pki, port, revoked)._check_coordinator()


def test_every_address_of_a_dns_name_is_checked_again_before_each_task(two_servers: tuple[Path, int], tmp_path: Path) -> None:
    pki, port = two_servers
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("client-9\n")
    node = client(pki, port, revoked)
    node._check_coordinator()  # both certificates read, neither revoked
    node._recheck_coordinator()
    revoked.write_text("generator\n")  # a live edit: re-read before the next task
    with pytest.raises(RevokedServer, match=f"refusing the coordinator at dns:///{NAME}:{port}: .*node generator is revoked"):
        node._recheck_coordinator()


@pytest.mark.parametrize("target, host", [("dns:///coord.example:50051", "coord.example"), ("10.0.0.5:7", "10.0.0.5"),
                                          ("[::1]:7", "::1"), ("dns:///[::1]:7", "::1")])
def test_the_data_plane_is_dialled_at_the_host_of_the_coordinator_target(target: str, host: str) -> None:
    assert data_plane.host_of(target) == host
