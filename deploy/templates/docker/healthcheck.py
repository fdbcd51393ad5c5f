#!/usr/bin/env python3
"""Container health probe: one grpc.health.v1 Check over mutual TLS, exit 0 when the service answers SERVING.

Kubernetes' built-in `grpc:` probe and plain TCP checks cannot present a client certificate, and fedsynth's
servers refuse any handshake without one (docs/security.md). This probe dials with the provision folder's
`operator` pair, the identity meant for operators' tools and health checks.

    fedsynth-healthcheck --address localhost:50051 --service fedsynth.v1.Coordinator --tls-dir /etc/fedsynth/tls
    fedsynth-healthcheck --address localhost:50052 --service fedsynth.v1.Generator --tls-dir ... --alive

Exit codes: 0 healthy; 1 answered but not SERVING (a generator still loading its model, a server draining on
SIGTERM); 2 no answer (not listening, handshake refused, deadline); 3 bad usage or unreadable TLS files.
With --alive any answer counts as healthy (liveness: the process is up, even while loading or draining).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedsynth.errors import FedsynthError
from fedsynth.wire.tls import TLSFiles, channel_credentials

HEALTHY, NOT_SERVING, NO_ANSWER, USAGE = 0, 1, 2, 3
OPERATOR = "operator"  # the node id whose pair (operator.pem, operator-key.pem) the probe presents


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsynth-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, metavar="HOST:PORT",
                        help="the server to check; with TLS a name in its certificate (localhost is always there)")
    parser.add_argument("--service", default="", help="service name, e.g. fedsynth.v1.Coordinator ('' = the server overall)")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--tls-dir", type=Path, help="provision folder with ca.pem, operator.pem, operator-key.pem")
    security.add_argument("--insecure", action="store_true", help="plaintext, for a server started with --insecure")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds for connecting and the Check (default %(default)s)")
    parser.add_argument("--alive", action="store_true", help="any answer is healthy, SERVING or not (liveness)")
    return parser


def check(address: str, service: str, credentials: grpc.ChannelCredentials | None, timeout_s: float) -> tuple[int, str]:
    """(exit code, one-line reason) of a single Check."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else type(exc).__name__
        return NO_ANSWER, f"{address} {service or '(server)'}: no answer ({code})"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    code = HEALTHY if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING
    return code, f"{address} {service or '(server)'}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        credentials = None if args.insecure else channel_credentials(TLSFiles.from_dir(args.tls_dir, OPERATOR))
    except FedsynthError as exc:
        print(f"fedsynth-healthcheck: error: {exc}", file=sys.stderr)
        return USAGE
    code, reason = check(args.address, args.service, credentials, args.timeout)
    if args.alive and code == NOT_SERVING:
        code = HEALTHY
    print(reason, file=sys.stdout if code == HEALTHY else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
