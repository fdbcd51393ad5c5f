"""FedGen over gRPC: label counts refused by name at Register (nothing registered), and `fedsynth run` on digits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, register_request


@pytest.mark.slow
def test_bad_label_counts_are_refused_by_name_and_register_nothing(runtime: Runtime, tmp_path: Path) -> None:
    coordinator = runtime.coordinator({"data.clients": 2, "train.rounds": 1, "train.algorithm": "fedgen"}, tmp_path / "run")
    with channel(coordinator.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)

        def register(counts: list[int], num_samples: int = 10) -> pb.RegisterReply:
            return stub.Register(register_request(spec, client_id=1, num_samples=num_samples, label_counts=counts), timeout=30)

        invalid, failed = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
        cases = {
            "none": (lambda: register([]), invalid, "reported 0 label counts; this run has 10 classes"),
            "too short": (lambda: register([5, 5]), invalid, "reported 2 label counts"),
            "too long": (lambda: register([1] * 10 + [0]), invalid, "reported 11 label counts"),
            "sum differs from N_k": (lambda: register([1] * 10, num_samples=11), invalid, "sum to 10, but it reported num_samples=11"),
            "overflowing count": (lambda: register([2**64 - 1] + [0] * 9, num_samples=1), invalid, str(2**64 - 1)),
        }
        for name, (call, code, fragment) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code, (name, info.value.details())
            assert fragment in info.value.details(), (name, info.value.details())
        with pytest.raises(grpc.RpcError) as info:  # none of the refused calls registered client 1
            stub.Heartbeat(pb.ClientHeartbeat(client_id=1, session="x"), timeout=30)
        assert info.value.code() == failed and "not registered" in info.value.details()

        assert register([1] * 10).session
        with pytest.raises(grpc.RpcError) as info:  # counts are reported once: a rejoin must repeat them
            register([2] * 5 + [0] * 5)
        assert info.value.code() == failed and "label counts" in info.value.details()
        assert register([1] * 10).session


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fedeas"])  # FedGen alone is the same server side with no synthetic images
def test_fedsynth_run_fedgen_trains_the_generator_every_round(tmp_path: Path, tiny_generator: Path, policy: str) -> None:
    out = tmp_path / policy
    sets = ["train.algorithm=fedgen", f"generation.policy={policy}", "data.clients=4", "train.rounds=3", "train.local_epochs=1",
            "runtime.clients_per_process=4", f"generation.model_dir={json.dumps(str(tiny_generator))}",
            "train.algorithm_params.gen_steps=20"]
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert len(report["rounds"]) == 3 and report["final_accuracy"] > 0.3, report["rounds"]
    rounds = json.loads((out / "coordinator.json").read_text())["rounds"]
    for r in rounds:  # after every round's FedAvg the server trained its generator on the 4 received heads
        assert r["generator_loss_first"] is not None and r["generator_loss_last"] is not None, r
    assert rounds[-1]["generator_loss_last"] < rounds[0]["generator_loss_first"]
