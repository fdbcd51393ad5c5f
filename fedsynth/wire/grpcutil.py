"""One place for gRPC servers and channels: options, health, retries with backoff, and SIGTERM handling."""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

KEEPALIVE_OPTIONS = [
    # Ping an idle connection every 10 s and drop it if no ack in 5 s: a vanished peer (kill -9, cable
    # pulled) is noticed in seconds instead of the OS's ~2 h TCP keepalive.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Long-lived dispatch streams sit idle between rounds; keep pinging them.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = KEEPALIVE_OPTIONS + [
    # Must allow the clients' 10 s pings, or the server answers them with GOAWAY (too_many_pings).
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    # Payloads travel in chunks well under gRPC's 4 MiB default, so the message limits stay at the default.
]
CHANNEL_OPTIONS = KEEPALIVE_OPTIONS + [
    # Reconnect quickly after a coordinator restart instead of backing off to gRPC's 120 s maximum.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


def make_server(
    *, max_workers: int = 32, max_concurrent_rpcs: int | None = None, extra_options: Sequence[tuple[str, int]] = ()
) -> grpc.Server:
    """A thread-pool server; RPCs past max_concurrent_rpcs get RESOURCE_EXHAUSTED (backpressure). extra_options
    are added to SERVER_OPTIONS (one role's own settings, e.g. the coordinator's upload flow control)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=SERVER_OPTIONS + list(extra_options),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `host:port` (port 0 picks a free one) and return the bound port."""
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address!r}")
    return port


def add_health(server: grpc.Server, service_name: str) -> health.HealthServicer:
    """Register grpc.health.v1; both the overall and the named service start NOT_SERVING."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", service_name):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def set_serving(servicer: health.HealthServicer, service_name: str) -> None:
    for name in ("", service_name):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def make_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def backoff_delays(*, initial_s: float = 0.2, maximum_s: float = 5.0, rng: random.Random | None = None):
    """Full-jitter exponential backoff: uniform(0, min(max, initial * 2^n)) for n = 0, 1, ..."""
    rng = rng or random.Random()
    ceiling = initial_s
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(maximum_s, ceiling * 2.0)


def call_with_retry(fn: Callable[[], T], *, deadline_s: float, what: str) -> T:
    """Call fn, retrying only UNAVAILABLE with jittered backoff until deadline_s seconds have passed."""
    stop_at = time.monotonic() + deadline_s
    for delay in backoff_delays():
        try:
            return fn()
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code not in RETRYABLE or time.monotonic() + delay > stop_at:
                raise
            log.info("%s: %s, retrying in %.2fs", what, code, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def wait_for_serving(channel: grpc.Channel, service_name: str, *, timeout_s: float) -> None:
    """Block until the peer's health service reports SERVING, or raise TimeoutError."""
    stub = health_pb2_grpc.HealthStub(channel)
    stop_at = time.monotonic() + timeout_s
    for delay in backoff_delays(initial_s=0.05, maximum_s=0.5):
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            break
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=min(remaining, 2.0))
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(min(delay, max(0.0, stop_at - time.monotonic())))
    raise TimeoutError(f"{service_name} was not SERVING within {timeout_s:.0f}s")


def stop_on_signals(
    server: grpc.Server,
    health_servicer: health.HealthServicer | None,
    *,
    grace_s: float = 5.0,
    before_stop: Callable[[], None] | None = None,
) -> threading.Event:
    """On SIGTERM/SIGINT: health goes NOT_SERVING, before_stop() ends long-lived streams, in-flight RPCs get
    grace_s, then the event is set."""
    stopped = threading.Event()

    def _handle(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down (grace %.1fs)", signum, grace_s)
        if health_servicer is not None:
            health_servicer.enter_graceful_shutdown()
        if before_stop is not None:
            before_stop()
        done = server.stop(grace_s)
        threading.Thread(target=lambda: (done.wait(), stopped.set()), daemon=True).start()

    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    return stopped
