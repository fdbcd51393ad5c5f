"""Secure aggregation against a real coordinator and real client-node processes: a round's model (and SCAFFOLD's
control variates) is the plain run's (to the quantisation step) when one client is killed between masking and
unmasking, another before its masked update (its masks rebuilt from its neighbours' shares) and a third sends wrong
shares; every refusal of a stage message costs its sender, not the run."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import checkpoint
from fedsynth.errors import ConfigError
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, config, read_record, register_request, wait_exit

ATTACK_NODE = Path(__file__).resolve().parent / "adversarial" / "attack_node.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Five clients on an IID split of digits, all sampled, one round: client 4 runs alone in its own process.
RUN = {"seed": 4, "data.clients": 5, "data.partition": "iid", "train.rounds": 1, "train.local_epochs": 1}
SECURE = {"runtime.secure_aggregation": True, "runtime.secagg_stage_timeout_s": 30.0}
QUANTUM = 1e-5  # far above the quantisation step here (clip 4, N = 1,438: ~3e-6 per client), far below a lost update


def play(root: Path, settings: dict[str, Any], attacks: dict[int, str] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the coordinator's record, the final global model and server state, the latter's keys prefixed "server.") of
    RUN; each attacked client alone in its own process (an attack that kills its process ends only that client), the
    honest ones together in one."""
    attacks = attacks or {}
    settings = {**RUN, **settings}
    with Runtime(root) as rt:
        coordinator = rt.coordinator(settings, root / "run")
        honest = rt.clients(coordinator.address, ",".join(str(c) for c in range(settings["data.clients"]) if c not in attacks))
        hostile = [rt.group.start(f"attack-node-{c}", [
            sys.executable, str(ATTACK_NODE), "--attacks", f"{c}={attack}", "--coordinator", coordinator.address, "--clients",
            str(c), "--torch-threads", "1", "--cache-dir", str(rt.root / "cache"), "--reconnect-timeout", "60", "--insecure"])
            for c, attack in attacks.items()]
        assert coordinator.wait(300) == 0, coordinator.log()[-3000:]
        assert wait_exit(honest, 60) == 0
        for child in hostile:
            wait_exit(child, 60)
        saved = checkpoint.load(root / "run")
        assert saved is not None
        return read_record(root / "run"), {**saved.global_state, **{f"server.{k}": v for k, v in saved.server_state.items()}}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a if a[key].is_floating_point())


def test_clients_killed_before_masking_and_before_unmasking_and_one_sending_wrong_shares_leave_the_plain_model(tmp_path: Path) -> None:
    """Eight SCAFFOLD clients (the masked vector carries each one's delta c too, summed into the server's control
    variates): 3 is killed after training, before its masked update (dropped: its pairwise masks are rebuilt from its
    neighbours' shares of its key), 5 after its masked update, before unmasking (a survivor: its seed comes from the
    others' shares), and 4 sends wrong shares (outvoted). Each secret has 7 holders and a threshold of 4: three faulty
    holders leave four. The model and the control variates are those of the plain run in which 3 never answers."""
    eight = {"data.clients": 8, "train.algorithm": "scaffold"}
    gone, plain = play(tmp_path / "plain", eight, {3: "vanish-before-upload"})
    secure, secure_model = play(tmp_path / "secure", {**SECURE, **eight},
                                {3: "vanish-before-mask", 4: "wrong-shares", 5: "vanish-before-unmask"})
    survivors = [0, 1, 2, 4, 5, 6, 7]
    assert gone["rounds"][0]["participants"] == secure["rounds"][0]["participants"] == survivors
    assert secure["success"] and secure["rounds"][0]["secure_aggregation"]["survivors"] == survivors
    assert secure["rounds"][0]["secure_aggregation"]["dropped"] == [3]
    assert largest_difference(secure_model, plain) < QUANTUM
    controls = [key for key in plain if key.startswith("server.")]
    assert controls and max(float(plain[key].abs().max()) for key in controls) > 100 * QUANTUM  # c moved, and matches


def test_a_malformed_or_out_of_turn_stage_message_costs_its_sender_the_round_not_the_run(tmp_path: Path) -> None:
    """Clients 4 and 5 speak the protocol by hand: 4 advertises a 31-byte key, 5 sends sealed shares before its keys;
    each of the four honest clients keeps 3 neighbours, the threshold (a majority of 5)."""
    with Runtime(tmp_path) as rt:
        coordinator = rt.coordinator({**RUN, **SECURE, "data.clients": 6}, tmp_path / "run")
        honest = rt.clients(coordinator.address, "0-3")
        stub = pb_grpc.CoordinatorStub(channel(coordinator.address))
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)
        sessions = {c: stub.Register(register_request(spec, client_id=c, num_samples=100), timeout=60).session for c in (4, 5)}
        streams = {c: stub.Subscribe(pb.SubscribeRequest(client_id=c, session=sessions[c]), timeout=300) for c in (4, 5)}
        done = threading.Event()

        def beat() -> None:  # the dispatch streams stay open while the tasks come (a silent client is dropped)
            while not done.wait(0.5):
                for c in (4, 5):
                    stub.Heartbeat(pb.ClientHeartbeat(client_id=c, session=sessions[c]), timeout=10)

        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        ids = {}
        for client, stream in streams.items():
            task = next(m.task for m in stream if m.WhichOneof("kind") == "task")
            ids[client] = {"client_id": client, "session": sessions[client], "round": task.round, "task_id": task.task_id}

        def refused(client: int, **stage: Any) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as caught:
                stub.SecureAggregation(pb.SecAggRequest(**ids[client], **stage), timeout=60)
            return caught.value

        short = refused(4, keys=pb.SecAggKeys(encryption=bytes(31), masking=bytes(range(32))))
        assert short.code() == grpc.StatusCode.INVALID_ARGUMENT and "client 4's encryption public key is 31 bytes" in short.details()
        early = refused(5, boxes=pb.SecAggBoxes(boxes={0: bytes(8)}, seed_commitment=bytes(32)))
        assert early.code() == grpc.StatusCode.INVALID_ARGUMENT and "belong to stage 2" in early.details()
        again = refused(4, keys=pb.SecAggKeys(encryption=bytes(range(32)), masking=bytes(range(1, 33))))
        assert again.code() == grpc.StatusCode.FAILED_PRECONDITION and "no part in round 1" in again.details()
        done.set()
        assert coordinator.wait(300) == 0, coordinator.log()[-3000:]
        assert wait_exit(honest, 60) == 0
        record = read_record(tmp_path / "run")
    assert record["success"] and record["rounds"][0]["participants"] == [0, 1, 2, 3]
    assert {entry["client"] for entry in record["refused_updates"]} == {4, 5}


@pytest.mark.parametrize(("setting", "named"), [
    ({"train.algorithm": "fedmix"}, "fedmix"),
    ({"train.aggregation": "median"}, "median"),
    ({"runtime.max_update_norm": 10.0}, "max_update_norm"),
    ({"runtime.wire_dtype": "float16"}, "wire_dtype"),
    ({"runtime.secagg_neighbours": 2, "runtime.secagg_threshold": 1}, "secagg_threshold = 1"),
])
def test_secure_aggregation_refuses_what_it_cannot_hide_by_name(setting: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config({**RUN, **SECURE, **setting})
