"""Raw bytes at every RPC of both services, as a hostile peer sends them: empty, truncated, garbage, oversized.

Each call ends with a status that names the problem (never INTERNAL or UNKNOWN), and the service stays
healthy and finishes its work afterwards.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.processes import fedsynth_command, wait_for_file
from fedsynth.wire import grpcutil
from fedsynth.generation.generator_client import fetch_images
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import generator_pb2 as gpb
from runtime_harness import Runtime, channel, read_record, wait_exit

GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"  # an unterminated varint tag
OVERSIZED = b"\x0a" + b"\xff\xff\xff\x02" + b"x" * (5 << 20)  # a 5 MiB field: past gRPC's 4 MiB receive limit
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}

COORDINATOR_METHODS = {  # method -> (request streaming, response streaming, a valid request)
    "GetRunSpec": (False, False, pb.GetRunSpecRequest()),
    "Register": (False, False, pb.RegisterRequest(client_id=1, num_samples=5, run_id="x" * 16)),
    "Subscribe": (False, True, pb.SubscribeRequest(client_id=1, session="s" * 32)),
    "Heartbeat": (False, False, pb.ClientHeartbeat(client_id=1, session="s" * 32)),
    "SubmitUpdate": (True, False, pb.UpdateChunk(header=pb.UpdateHeader(client_id=1, session="s" * 32, task_id="t" * 16))),
    "WatchRounds": (False, True, pb.WatchRequest()),
    "UploadSynthetic": (True, False, pb.SyntheticChunk(header=pb.SyntheticHeader(client_id=1, session="s" * 32, dtype="uint8"))),
    "UploadMeanData": (True, False, pb.MeanDataChunk(header=pb.MeanDataHeader(client_id=1, session="s" * 32, count=3, mean_batch=5))),
    "ReportSetupFailure": (False, False, pb.SetupFailure(client_id=1, session="s" * 32, reason="DP-GAN training failed")),
}
GENERATOR_METHODS = {
    "Generate": (False, True, gpb.GenerateRequest(counts=[3, 2], seed=1, model_id="m" * 20)),
    "Info": (False, False, gpb.InfoRequest()),
    "Vary": (False, True, gpb.VaryRequest(images=bytes(64), labels=[1], strength=0.5, seed=1, height=8, width=8, channels=1)),
}


def _call(ch: grpc.Channel, service: str, method: str, streaming: tuple[bool, bool], data: bytes) -> grpc.RpcError | None:
    path = f"/{service}/{method}"
    request_streaming, response_streaming = streaming
    try:
        if request_streaming:
            ch.stream_unary(path)(iter([data]), timeout=20)
        elif response_streaming:
            for _ in ch.unary_stream(path)(data, timeout=3):
                pass
        else:
            ch.unary_unary(path)(data, timeout=20)
    except grpc.RpcError as exc:
        return exc
    return None


def _barrage(ch: grpc.Channel, service: str, methods: dict[str, tuple[bool, bool, object]]) -> list[str]:
    seen = []
    for method, (req_stream, resp_stream, valid) in methods.items():
        whole = valid.SerializeToString()
        for name, data in {"garbage": GARBAGE, "truncated": whole[: len(whole) // 2 + 1], "oversized": OVERSIZED, "empty": b""}.items():
            error = _call(ch, service, method, (req_stream, resp_stream), data)
            if error is None or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                assert name in ("empty", "truncated"), (method, name)  # a request that parses may be valid
                continue
            assert error.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, name, error.details())
            if name in ("garbage", "oversized"):
                assert error.code() in REFUSALS, (method, name, error.code(), error.details())
            assert error.details(), (method, name)
            seen.append(f"{method}/{name}: {error.code().name}: {error.details()}")
    return seen


def _serving(ch: grpc.Channel, service: str) -> bool:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_coordinator_answers_every_bad_byte_string_and_then_runs_normally(runtime: Runtime, tmp_path: Path) -> None:
    settings = {"data.clients": 2, "train.rounds": 1, "train.local_epochs": 1}
    coordinator = runtime.coordinator(settings, tmp_path / "run")
    with channel(coordinator.address) as ch:
        seen = _barrage(ch, "fedsynth.v1.Coordinator", COORDINATOR_METHODS)
        assert any("malformed RegisterRequest" in line for line in seen), seen
        assert _serving(ch, "fedsynth.v1.Coordinator")
    clients = runtime.clients(coordinator.address, "0-1")
    assert coordinator.wait(timeout_s=180) == 0, coordinator.log()[-2000:]
    assert wait_exit(clients, 30) == 0
    record = read_record(tmp_path / "run")
    assert record["success"] and record["rounds"][0]["participants"] == [0, 1]


@pytest.mark.slow
def test_generator_answers_every_bad_byte_string_and_then_serves(runtime: Runtime, tiny_generator: Path) -> None:
    port_file = runtime.root / "generator.port"
    child = runtime.group.start("generator", fedsynth_command(
        "generator", "serve", "--model", str(tiny_generator), "--port", "0", "--port-file", str(port_file),
        "--metrics-port", "-1", "--ddim-steps", "2", "--threads", "1", "--insecure"))
    address = f"127.0.0.1:{wait_for_file(port_file, child, timeout_s=90)}"
    with channel(address) as ch:
        grpcutil.wait_for_serving(ch, "fedsynth.v1.Generator", timeout_s=90)
        seen = _barrage(ch, "fedsynth.v1.Generator", GENERATOR_METHODS)
        assert any("malformed GenerateRequest" in line for line in seen), seen
        assert _serving(ch, "fedsynth.v1.Generator")
        labels: list[int] = []
        fetch_images(ch, [3, 2], seed=1, timeout_s=60, on_batch=lambda y, x, first: labels.extend(y.tolist()))
        assert labels == [0, 0, 0, 1, 1]
    child.process.terminate()
    assert child.process.wait(timeout=30) == 0
