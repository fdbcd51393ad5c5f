"""The coordinator's gRPC server: the Coordinator service over a Federation, with health, TLS and backpressure."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from coordinator.data_plane import DataPlaneServer
from coordinator.federation import Federation
from coordinator.metrics import CoordinatorMetrics
from coordinator.servicer import MAX_WATCHERS, SERVICE_NAME, CoordinatorServicer
from fedsynth.wire import grpcutil, tls
from fedsynth.config import RunConfig
from fedsynth.wire.strict_decoding import add_strictly
from fedsynth.wire.raw_messages import parsing_chunks
from fedsynth.v1 import coordinator_pb2, coordinator_pb2_grpc

# With mutual TLS, the client id each of these RPCs claims must be the caller's certificate's (else PERMISSION_DENIED).
CLAIMED_CLIENT_ID: dict[str, tls.ClaimedClientId] = {
    "Register": lambda request: request.client_id,
    "Subscribe": lambda request: request.client_id,
    "Heartbeat": lambda request: request.client_id,
    "SubmitUpdate": lambda first: first.header.client_id if first.WhichOneof("kind") == "header" else None,
    "UploadSynthetic": lambda first: first.header.client_id if first.WhichOneof("kind") == "header" else None,
    "UploadMeanData": lambda first: first.header.client_id if first.WhichOneof("kind") == "header" else None,
    "ReportSetupFailure": lambda request: request.client_id,
    "SubmitEvaluation": lambda request: request.client_id,
    "SecureAggregation": lambda request: request.client_id,
}

# With mutual TLS, only an operator certificate (the launcher's) may call these: a client's certificate cannot hold
# WatchRounds streams (each a worker thread) nor release other clients.
OPERATOR_ONLY = frozenset({"ReleaseClients", "WatchRounds"})

# Flow control for uploads: each SubmitUpdate stream may have at most this many unread bytes buffered in gRPC. A stream
# waiting for a receive slot (coordinator.receive_slots) is not read; without a bound, gRPC's BDP probe grows every
# stream's window until a whole upload or more can sit in its buffers, per stream, besides the buffer the update is
# received into.
UPLOAD_FLOW_CONTROL_OPTIONS = [
    # no bandwidth-delay-product probing: the window stays at lookahead_bytes instead of growing with the link
    ("grpc.http2.bdp_probe", 0),
    # the per-stream window the server announces (default 64 KiB before BDP growth): two 1 MiB chunks in flight
    ("grpc.http2.lookahead_bytes", 2 << 20),
]


@dataclass
class CoordinatorServer:
    server: grpc.Server
    health: health.HealthServicer
    federation: Federation
    port: int
    liveness_stop: threading.Event
    data_plane: DataPlaneServer | None = None

    def stop(self, grace_s: float = 2.0) -> None:
        """Graceful: health says NOT_SERVING, open dispatch streams end, in-flight RPCs get grace_s."""
        self.liveness_stop.set()
        self.health.enter_graceful_shutdown()
        self.federation.close_streams()
        if self.data_plane is not None:
            self.data_plane.stop()
        self.server.stop(grace=grace_s).wait(grace_s + 3.0)


def create_server(
    cfg: RunConfig,
    *,
    out_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    data_port: int = 0,
    security: tls.ServerSecurity | None = None,
    metrics: CoordinatorMetrics | None = None,
    generator: str | None = None,
    generator_credentials: grpc.ChannelCredentials | None = None,
) -> tuple[CoordinatorServer, int]:
    """Build the federation (data, model, checkpoint resume), bind host:port (0 picks a free port) and, with
    runtime.data_plane = "tcp", the data plane on host:data_port, start serving and report SERVING; the rounds start
    only when the caller runs `server.federation.run()`."""
    security = security or tls.ServerSecurity(files=None)
    credentials = security.credentials()
    federation = Federation(cfg, out_dir, metrics or CoordinatorMetrics(), generator=generator, credentials=generator_credentials)
    # A dispatch stream holds a worker thread per connected client; leave room for uploads and health checks. RPCs past
    # the workers are refused RESOURCE_EXHAUSTED (a client retries) instead of queueing without bound behind them.
    workers = max(16, 2 * cfg.data.clients + 8)
    server = grpcutil.make_server(max_workers=workers, max_concurrent_rpcs=workers + MAX_WATCHERS,
                                  extra_options=UPLOAD_FLOW_CONTROL_OPTIONS)
    servicer = CoordinatorServicer(federation, cfg.runtime.heartbeat_s)
    add_strictly(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, security.guard(servicer, CLAIMED_CLIENT_ID, OPERATOR_ONLY), server,
                 parsers={"SubmitUpdate": parsing_chunks(coordinator_pb2.UpdateChunk.FromString)})  # chunks as views: no copies
    health_servicer = grpcutil.add_health(server, SERVICE_NAME)

    def not_serving() -> None:  # the data plane's admission loop died: no transfer can start, so say so
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    data_plane = None
    if cfg.runtime.data_plane == "tcp":  # shares the receive slots and buffers: two large updates at once, whichever path
        data_plane = DataPlaneServer(federation, servicer.receive_slots, host=host, port=data_port, revoked=security.revoked,
                                     tls=None if security.files is None else tls.ssl_server_context(security.files),
                                     receive_buffers=servicer.receive_buffers, on_dead=not_serving)
        federation.data_port = data_plane.port
    bound = grpcutil.bind(server, f"{host}:{port}", credentials)
    server.start()
    if data_plane is not None:
        data_plane.start()
    grpcutil.set_serving(health_servicer, SERVICE_NAME)
    if data_plane is not None and data_plane.dead:  # died before SERVING was set: on_dead's NOT_SERVING came first
        not_serving()
    liveness_stop = threading.Event()
    threading.Thread(target=federation.check_liveness, args=(liveness_stop,), name="liveness", daemon=True).start()
    return CoordinatorServer(server, health_servicer, federation, bound, liveness_stop, data_plane), bound
