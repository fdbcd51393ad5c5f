"""Prometheus helpers shared by every process: the /metrics endpoint and the common bucket layouts."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)

# Seconds, from a fast RPC to a full local-training round on a CPU.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int | None:
    """Serve /metrics on host:port (0 picks a free port; a negative port disables it); return the bound port."""
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
