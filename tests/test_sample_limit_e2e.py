"""data.max_samples_per_client over real gRPC: a registration above it is refused by name, and a real client node whose
shard is too large stops at once (exit 1) instead of retrying."""

from __future__ import annotations

import grpc
import pytest

from fedsynth.assembly import client_shard
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, config, wait_exit, register_request

SETTINGS = {"seed": 5, "data.clients": 2, "runtime.registration_timeout_s": 120.0}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_client_above_the_sample_limit_is_refused_at_registration(runtime: Runtime, tmp_path) -> None:
    sizes = {k: len(client_shard(config(SETTINGS), k).y) for k in range(2)}
    small, large = sorted(sizes, key=sizes.get)
    assert sizes[small] < sizes[large]
    limit = sizes[small]
    coordinator = runtime.coordinator({**SETTINGS, "data.max_samples_per_client": limit}, tmp_path / "run")
    with channel(coordinator.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=30, wait_for_ready=True)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(register_request(spec, client_id=small, num_samples=limit + 1), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == (f"client {small} registered N_k={limit + 1} samples, above "
                                           f"data.max_samples_per_client={limit}: refused")
    client = runtime.clients(coordinator.address, str(large))
    assert wait_exit(client, 120) == 1
    log = client.log_path.read_text()
    assert f"registration refused: client {large} registered N_k={sizes[large]} samples, above data.max_samples_per_client={limit}" in log
    assert "reconnecting" not in log
    assert f"client {large} refused: N_k={sizes[large]} above data.max_samples_per_client={limit}" in coordinator.log()
