"""Local mode end to end: over the folders `fedsynth data split` writes, `fedsynth run` trains exactly as split mode
with the same seed, and a client whose data does not fit the label schema is refused while the others go on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from coordinator import checkpoint
from deploy.processes import fedsynth_command
from fedsynth.assembly import model_for
from fedsynth.config import load_config
from fedsynth.learning.data import load_dataset
from fedsynth.learning.training import TrainData, evaluate, images_to_tensor
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, read_record, wait_exit, register_request

SPLIT_FLAGS = ["--dataset", "digits", "--alpha", "0.1", "--seed", "3", "--holdout-fraction", "0.1"]
ROUNDS = 2
RUN = ["data.clients=4", "seed=3", "data.holdout_fraction=0.1", f"train.rounds={ROUNDS}", "train.local_epochs=1",
       "runtime.clients_per_process=4", "generation.evaluate_per_class=0"]
ARMS = {  # FedEAS trains as FedAvg does over the same folders, its images added: plain FedAvg needs no arm of its own
    "fedeas": ["generation.policy=\"fedeas\""],
    # the holdout generator: split mode's hold-out split, or in local mode data split's holdout/ folder
    "fedeas-holdout": ["generation.policy=\"fedeas\"", "generation.backend=\"holdout\""],
}


def _split(out: Path, clients: int) -> Path:
    done = subprocess.run([*fedsynth_command("data", "split", *SPLIT_FLAGS, "--clients", str(clients), "--out", str(out))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _run(out: Path, sets: list[str]) -> dict:
    command = fedsynth_command("run", "--out-dir", str(out), "--no-progress")
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "coordinator.json").read_text())


def _accuracy(sets: list[str], out: Path) -> float:
    """The final global model (from the checkpoint) on digits' test split, as split mode's coordinator tests it."""
    cfg = load_config(None, sets)
    test = load_dataset("digits", "test")
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    ckpt = checkpoint.load(out)
    assert ckpt is not None
    model.load_state_dict(ckpt.global_state)
    return evaluate(model, TrainData(images_to_tensor(test.x), torch.as_tensor(test.y)), 512)[1]


@pytest.mark.slow
@pytest.mark.parametrize("arm", list(ARMS))
def test_local_mode_over_split_folders_trains_exactly_as_split_mode(tmp_path: Path, tiny_generator: Path, arm: str) -> None:
    folders = _split(tmp_path / "clients", 4)
    sets = [*RUN, *ARMS[arm], f"generation.model_dir={json.dumps(str(tiny_generator))}"]
    split = _run(tmp_path / "split", sets)
    local_sets = [*sets, 'data.source="local"', f"data.local_dir={json.dumps(str(folders))}"]
    local = _run(tmp_path / "local", local_sets)
    assert split["success"] and local["success"]
    # Local mode evaluates federated on the clients' test folders, which hold digits' whole test split between them: the
    # weighted accuracy (correct over examples, summed over the clients) is split mode's server accuracy, round by round.
    assert [r["accuracy"] for r in local["rounds"]] == [r["accuracy"] for r in split["rounds"]]
    for key in ("round", "participants"):
        assert [r[key] for r in local["rounds"]] == [r[key] for r in split["rounds"]], key
    # The round's train_loss is a mean over the clients in the order their updates arrived: equal up to the last bit.
    assert [r["train_loss"] for r in local["rounds"]] == pytest.approx([r["train_loss"] for r in split["rounds"]], rel=1e-12)
    if arm.startswith("fedeas"):
        images = {cid: g["images"] for cid, g in local["generation"].items()}
        assert images == {cid: g["images"] for cid, g in split["generation"].items()} and sum(images.values()) > 0
    split_state = checkpoint.load(tmp_path / "split").global_state  # type: ignore[union-attr]
    local_state = checkpoint.load(tmp_path / "local").global_state  # type: ignore[union-attr]
    assert split_state.keys() == local_state.keys()
    assert all(torch.equal(split_state[name], local_state[name]) for name in split_state)  # bit for bit
    assert _accuracy(local_sets, tmp_path / "local") == split["rounds"][-1]["accuracy"]


@pytest.mark.slow
def test_data_test_dir_gives_the_coordinator_its_own_test_set_beside_federated_evaluation(tmp_path: Path) -> None:
    """Local mode with data.test_dir: the coordinator tests on its own folder (here digits' whole test split, written by
    a one-client `data split`) while the clients test on theirs (which hold that same split between them), so under
    train.evaluation = "both" the server's accuracy equals the federated weighted accuracy, round by round."""
    whole = _split(tmp_path / "whole", 1) / "client-0"
    folders = _split(tmp_path / "clients", 2)
    sets = [*RUN, "data.clients=2", 'generation.policy="none"', 'data.source="local"',
            f"data.local_dir={json.dumps(str(folders))}", f"data.test_dir={json.dumps(str(whole))}", 'train.evaluation="both"']
    record = _run(tmp_path / "run", sets)
    assert record["success"] and len(record["rounds"]) == ROUNDS
    server = [r["accuracy"] for r in record["rounds"]]
    assert all(a is not None for a in server)
    assert server == [r["federated_evaluation"]["weighted_accuracy"] for r in record["rounds"]]
    assert sum(c["examples"] for c in record["rounds"][-1]["federated_evaluation"]["per_client"].values()) == len(
        load_dataset("digits", "test").y)


@pytest.mark.slow
def test_a_client_with_a_class_outside_the_schema_is_refused_and_the_run_goes_on(tmp_path: Path, runtime: Runtime) -> None:
    folders = _split(tmp_path / "clients", 3)
    wolf = folders / "client-2" / "train" / "wolf"
    wolf.mkdir()
    first_png = next((folders / "client-2" / "train").rglob("*.png"))
    (wolf / "999999.png").write_bytes(first_png.read_bytes())
    settings = {"data.source": "local", "data.clients": 3, "seed": 3, "data.holdout_fraction": 0.1, "train.rounds": 2,
                "train.local_epochs": 1, "runtime.quorum": 0.5}
    coord = runtime.coordinator(settings, tmp_path / "run")
    clients = [runtime.group.start(f"client-{k}", fedsynth_command(
        "client", "--coordinator", coord.address, "--clients", str(k), "--data", str(folders / f"client-{k}"),
        "--cache-dir", str(tmp_path / "cache"), "--insecure")) for k in range(3)]
    assert coord.wait(240) == 0, coord.log()[-3000:]
    assert wait_exit(clients[2], 60) == 1
    assert [wait_exit(c, 60) for c in clients[:2]] == [0, 0]
    refusal = "client 2: data.classes: expected only the run's class names, found 'wolf' not in data.classes"
    assert [line for line in coord.log().splitlines() if "refused" in line] == [
        line for line in coord.log().splitlines() if line.endswith(f"refused {refusal}")]
    assert sum(line.endswith(f"refused {refusal}") for line in coord.log().splitlines()) == 1
    assert f"client 2: run over (registration refused: {refusal})" in clients[2].log_path.read_text()
    record = read_record(tmp_path / "run")
    assert record["success"] and len(record["rounds"]) == 2
    assert all(r["participants"] == [0, 1] for r in record["rounds"])


@pytest.mark.slow
def test_a_second_node_claiming_a_live_client_id_is_refused_and_a_reconnect_is_not(tmp_path: Path, runtime: Runtime) -> None:
    coord = runtime.coordinator({"data.clients": 2, "runtime.heartbeat_s": 5.0, "runtime.heartbeat_timeout_s": 60.0},
                                tmp_path / "run")
    channel = grpc.insecure_channel(coord.address)
    stub = pb_grpc.CoordinatorStub(channel)
    spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)

    def register(token: str) -> pb.RegisterReply:
        return stub.Register(register_request(spec, client_id=0, num_samples=10, node_token=token), timeout=30)

    first = register("node-a")
    with pytest.raises(grpc.RpcError) as caught:
        register("node-b")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith("client 0: two nodes claim client id 0: another node holds it")
    assert register("node-a").session != first.session  # the same node again: a reconnect, admitted
    channel.close()
