"""Prometheus helpers shared by every process: the /metrics endpoint (HTTP, or HTTPS with mutual TLS) and bucket layouts."""

from __future__ import annotations

import argparse
import logging
import math
import socket
import ssl
import threading
import time
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from fedsynth.errors import ConfigError
from fedsynth.process.connection_slots import ConnectionSlots, Slot
from fedsynth.process.runtime import write_atomic
from fedsynth.wire.tls import LOOPBACK, AuthenticationError, RevocationList, TLSFiles, identity_of, is_loopback, ssl_server_context

log = logging.getLogger(__name__)

# Seconds, from a fast RPC to a full local-training round on a CPU.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# A connection must finish its TLS handshake and send its request within REQUEST_DEADLINE_S of being accepted, and is
# ended RESPONSE_DEADLINE_S after it in any case (Prometheus's default scrape timeout); at most MAX_CONNECTIONS at once.
REQUEST_DEADLINE_S = 2.0
RESPONSE_DEADLINE_S = 10.0
MAX_CONNECTIONS = 16


def add_metrics_arguments(parser: argparse.ArgumentParser, *, default_port: int = -1, linger: bool = False) -> None:
    """The --metrics-* flags; `linger` adds --metrics-linger-s for roles whose process ends with its run."""
    group = parser.add_argument_group("Prometheus /metrics (HTTPS with this node's certificate when it runs with mutual TLS)")
    group.add_argument("--metrics-port", type=int, default=default_port,
                       help="/metrics port; 0 picks a free one, -1 disables (default %(default)s)")
    group.add_argument("--metrics-port-file", type=Path, help="write the bound metrics port to this file (atomically)")
    group.add_argument("--metrics-host", default=LOOPBACK, help="address /metrics listens on; this machine's address "
                       "or 0.0.0.0 for a Prometheus on another machine (default %(default)s)")
    group.add_argument("--metrics-insecure", action="store_true", help="serve /metrics as plain HTTP, unauthenticated, "
                       "even with --tls-dir; needed for a non-loopback --metrics-host without TLS")
    if not linger:
        return
    group.add_argument("--metrics-linger-s", type=float, default=0.0, metavar="S",
                       help="after the run ends, keep /metrics up until one more scrape has read the final counters, "
                       "at most S seconds (a signal ends the wait; default 0: exit at once)")


def serves_https(files: TLSFiles) -> bool:
    """Whether the certificate may act as a TLS server's (extended key usage serverAuth, or no restriction)."""
    cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.SERVER_AUTH in usages


def choose_metrics_tls(port: int, host: str, insecure: bool, files: TLSFiles | None) -> TLSFiles | None:
    """The files /metrics serves HTTPS with (the node's own), or None for plain HTTP; plain HTTP off loopback needs
    --metrics-insecure. Raises ConfigError before anything is bound."""
    if port < 0:
        return None
    if port > 65535:
        raise ConfigError(f"--metrics-port must be in -1..65535, got {port}")
    if files is not None and not insecure and serves_https(files):
        return files
    if not insecure and not is_loopback(host):
        if files is None:
            raise ConfigError(f"--metrics-host {host} is not loopback and /metrics would be plain HTTP: run with "
                              "--tls-dir (then /metrics is HTTPS, client certificate required) or pass --metrics-insecure")
        raise ConfigError(f"--metrics-host {host} is not loopback but certificate {files.cert} is for TLS clients only, so "
                          "/metrics cannot be HTTPS: provision with `fedsynth deploy provision --client-hosts HOST` or pass "
                          "--metrics-insecure")
    if insecure and not is_loopback(host):
        log.warning("plain HTTP /metrics on %s (--metrics-insecure): anyone who reaches it reads the metrics", host)
    elif files is not None and not insecure:
        log.info("certificate %s is for TLS clients only: /metrics stays plain HTTP on %s", files.cert, host)
    return None


class _QuietHandler(WSGIRequestHandler):
    server: MetricsHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape would drown the process's log

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.request_read()
        return parsed


class MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's WSGI app on a threading server. With TLS, the handshake runs in the connection's own thread
    (prometheus_client's start_http_server does it in the accept loop, where one idle connection stalls every scrape),
    and the peer must hold a fedsynth node identity that is not revoked (else 403). At most MAX_CONNECTIONS threads,
    each connection with a whole deadline (ConnectionSlots), so a flood of idle or trickling peers holds no more."""

    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS  # the kernel's backlog while the accept loop waits for a slot

    def __init__(self, host: str, port: int, registry: CollectorRegistry, context: ssl.SSLContext | None,
                 revoked: RevocationList | None) -> None:
        try:
            self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as exc:
            raise ConfigError(f"--metrics-host {host!r} does not resolve ({exc.strerror})") from None
        self.context = context
        self.revoked = revoked
        self._requests = threading.Condition()
        self._started = 0  # requests whose handling began (each gets the next number)
        self._answered_since = 0  # the highest such number whose handling ended
        self.slots = ConnectionSlots(MAX_CONNECTIONS, request_s=REQUEST_DEADLINE_S, response_s=RESPONSE_DEADLINE_S)
        self._connection = threading.local()  # the Slot of the connection this thread serves
        try:
            super().__init__((host, port), _QuietHandler)
        except OSError as exc:
            raise ConfigError(f"cannot serve /metrics on {host}:{port}: {exc.strerror}") from None
        self.set_app(make_wsgi_app(registry))

    def process_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        """In the accept loop: a slot first (waiting, or evicting an idle peer, at the cap), then the connection's thread."""
        slot = self.slots.admit(request)
        if slot is None:  # closing
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve_connection, args=(request, client_address, slot),
                         name="metrics-connection", daemon=True).start()

    def _serve_connection(self, request: socket.socket, client_address: tuple[str, int], slot: Slot) -> None:
        self._connection.slot = slot
        try:
            if self.context is not None:
                secured = self._handshake(request, client_address)
                if secured is None:
                    return
                request = secured
            self._answer(request, client_address)
        finally:
            self.slots.release(slot)

    def request_read(self) -> None:
        """The handler has read a request's headers: its connection may take until the response deadline."""
        slot = getattr(self._connection, "slot", None)
        if slot is not None:
            self.slots.mark_requested(slot)

    def server_close(self) -> None:
        super().server_close()
        self.slots.close()

    def _answer(self, request: socket.socket, client_address: tuple[str, int]) -> None:
        with self._requests:
            self._started += 1
            number = self._started
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._requests:
                self._answered_since = max(self._answered_since, number)
                self._requests.notify_all()

    def wait_for_next_request(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Block until a request that began after this call has been answered (the next scrape read the counters as
        they are now), `timeout_s` passes or `stop` is set; whether it was answered."""
        deadline = time.monotonic() + timeout_s
        with self._requests:
            begun = self._started
            while self._answered_since <= begun:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._requests.wait(min(left, 0.2))  # short waits: `stop` is an Event, not this condition
            return True

    def _handshake(self, raw: socket.socket, address: tuple[str, int]) -> ssl.SSLSocket | None:
        assert self.context is not None
        raw.settimeout(RESPONSE_DEADLINE_S)  # per read; ConnectionSlots ends the whole handshake at REQUEST_DEADLINE_S
        conn = self.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        try:
            conn.do_handshake()
        except (OSError, ValueError) as exc:  # no client certificate, another CA, plain HTTP, a timeout
            log.debug("/metrics handshake with %s failed: %s", address[0], exc)
            _close_gently(conn)
            return None
        reason = self._refusal(conn)
        if reason is None:
            return conn
        log.warning("/metrics refused %s: %s", address[0], reason)
        body = reason.encode()
        try:
            conn.sendall(b"HTTP/1.0 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        _close_gently(conn)
        return None

    def _refusal(self, conn: ssl.SSLSocket) -> str | None:
        der = conn.getpeercert(binary_form=True)
        if der is None:
            return "the peer presented no client certificate"
        try:
            peer = identity_of(x509.load_der_x509_certificate(der))
        except AuthenticationError as exc:
            return str(exc)
        return None if self.revoked is None else self.revoked.reason(peer)


def _close_gently(conn: ssl.SSLSocket) -> None:
    """After a failed handshake: half-close, then read what the peer already sent (its request) before closing.
    Closing with unread input sends a reset that can overtake the TLS alert; the peer then sees a bare EOF
    instead of "certificate required" (measured: ~45% of refusals)."""
    try:
        conn.shutdown(socket.SHUT_WR)  # drops the TLS layer: recv below reads the raw socket
        conn.settimeout(1.0)
        for _ in range(16):
            if not conn.recv(65536):
                break
    except OSError:
        pass
    finally:
        conn.close()


def serve_metrics(port: int, host: str = LOOPBACK, *, tls: TLSFiles | None = None, revoked: RevocationList | None = None,
                  registry: CollectorRegistry = REGISTRY) -> MetricsHTTPServer | None:
    """Serve /metrics on host:port (0 picks a free port; a negative port disables it), HTTPS when `tls` is given;
    returns the running server (.server_port, .shutdown(), .server_close()). Callers choose `tls` with
    choose_metrics_tls, which refuses plain HTTP off loopback."""
    if port < 0:
        return None
    server = MetricsHTTPServer(host, port, registry, None if tls is None else ssl_server_context(tls), revoked)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    scheme = "http" if tls is None else "https"
    log.info("metrics on %s://%s:%d/metrics%s", scheme, host, server.server_port,
             "" if tls is None else " (client certificate from the CA required)")
    return server


def serve_metrics_from_args(args: argparse.Namespace, files: TLSFiles | None, revoked: RevocationList | None = None,
                            registry: CollectorRegistry = REGISTRY) -> MetricsHTTPServer | None:
    """What every role calls with its add_metrics_arguments flags and its own TLS files: serve, write the port file,
    return the running server (None when disabled)."""
    linger_s = getattr(args, "metrics_linger_s", 0.0)
    if not math.isfinite(linger_s) or linger_s < 0:
        raise ConfigError(f"--metrics-linger-s must be a finite number >= 0, got {linger_s}")
    tls = choose_metrics_tls(args.metrics_port, args.metrics_host, args.metrics_insecure, files)
    server = serve_metrics(args.metrics_port, args.metrics_host, tls=tls, revoked=revoked, registry=registry)
    if server is None:
        return None
    if args.metrics_port_file is not None:
        write_atomic(Path(args.metrics_port_file), f"{server.server_port}\n")
    return server


def linger_for_final_scrape(server: MetricsHTTPServer | None, linger_s: float, stop: threading.Event | None = None) -> None:
    """At the end of a run: a scraper polling every few seconds would miss the last counters of a process that exits
    at once, so wait (bounded) until one more request has been answered."""
    if server is None or linger_s <= 0:
        return
    log.info("waiting up to %.1f s for a last scrape of /metrics (--metrics-linger-s)", linger_s)
    if not server.wait_for_next_request(linger_s, stop):
        log.info("no scrape of /metrics within %.1f s; exiting", linger_s)
