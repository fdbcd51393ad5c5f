"""coordinator.server.create_server in-process: binds port 0, serves health and the run spec, stops cleanly."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.server import create_server
from coordinator.servicer import SERVICE_NAME
from fedsynth.config import from_json
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import channel, config


def test_create_server_serves_health_and_the_run_spec(tmp_path: Path) -> None:
    cfg = config({"data.clients": 3, "train.rounds": 2})
    coordinator, port = create_server(cfg, out_dir=tmp_path / "run", port=0)
    try:
        assert port > 0 and coordinator.port == port
        with channel(f"127.0.0.1:{port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            spec = pb_grpc.CoordinatorStub(ch).GetRunSpec(pb.GetRunSpecRequest(), timeout=10)
        assert spec.run_id == cfg.fingerprint() == coordinator.federation.run_id
        assert spec.num_clients == 3
        assert from_json(spec.config_json) == cfg
        # the initial model is evaluated by the round loop, after the server binds (minutes for ResNet-18 on a CPU)
        assert coordinator.federation.completed == 0 and coordinator.federation.initial == {}
    finally:
        coordinator.stop(grace_s=0.5)
    with channel(f"127.0.0.1:{port}") as ch:  # stopped: nothing answers on that port any more
        try:
            pb_grpc.CoordinatorStub(ch).GetRunSpec(pb.GetRunSpecRequest(), timeout=2)
            raise AssertionError("the stopped server still answered")
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
