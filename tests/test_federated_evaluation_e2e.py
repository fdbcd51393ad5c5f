"""A real run with federated evaluation (`fedsynth run`: coordinator and a client node as processes): report.json's
federated figures equal a hand computation from the clients' counts, the counts are the final model's on each client's
held-out examples, the worst client is named; and over raw gRPC, counts that do not add up are refused by name and a
sampled client that vanishes without answering is left out instead of holding the run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import checkpoint
from fedsynth.assembly import client_shard, local_test_split, model_for
from fedsynth.config import load_config
from fedsynth.learning.training import images_to_tensor
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from fedsynth.wire import codec
from runtime_harness import Runtime, channel, read_record, wait_until, register_request

SETTINGS = [
    "seed=3", "data.clients=4", "train.rounds=3", "train.local_epochs=1", "generation.policy=none",
    "runtime.clients_per_process=4", "train.evaluation='both'", "train.eval_every=2", "train.fraction_evaluate=0.75",
]
RPC_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("federated") / "run"
    command = [sys.executable, "-m", "fedsynth.cli", "run", *[a for s in SETTINGS for a in ("--set", s)], "--out-dir", str(out),
               "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def percentile_by_hand(values: list[float], q: float) -> float:
    """Linear interpolation between the two closest ranks (numpy's default), written out."""
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_federated_figures_equal_a_hand_computation_from_the_clients_counts(run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    evaluations = report["federated_evaluation"]
    assert [e["round"] for e in evaluations] == [2, 3]  # every eval_every = 2 rounds, and the last
    assert all(r["accuracy"] is not None for r in report["rounds"])  # "both": the coordinator still tests every round
    for e in evaluations:
        clients = e["per_client"]
        assert len(e["sampled"]) == 3 and set(map(int, clients)) == set(e["sampled"])  # 0.75 of K = 4; all answered
        correct = {int(c): v["correct"] for c, v in clients.items()}
        examples = {int(c): v["examples"] for c, v in clients.items()}
        accuracy = {c: correct[c] / examples[c] for c in correct}
        assert e["weighted_accuracy"] == pytest.approx(sum(correct.values()) / sum(examples.values()))
        assert e["mean_accuracy"] == pytest.approx(sum(accuracy.values()) / len(accuracy))
        worst = min(sorted(accuracy), key=lambda c: accuracy[c])
        assert e["worst_client"] == worst and e["worst_accuracy"] == pytest.approx(accuracy[worst])
        assert e["p10_accuracy"] == pytest.approx(percentile_by_hand(list(accuracy.values()), 10))
        assert e["spread"] == pytest.approx(max(accuracy.values()) - min(accuracy.values()))
        for c, v in clients.items():
            assert v["accuracy"] == pytest.approx(accuracy[int(c)])
            assert sum(v["class_total"]) == v["examples"] and sum(v["class_correct"]) == v["correct"]
        for label, recall in enumerate(e["per_class_recall"]):
            total = sum(v["class_total"][label] for v in clients.values())
            hits = sum(v["class_correct"][label] for v in clients.values())
            assert recall == (pytest.approx(hits / total) if total else None), label
    assert evaluations[0] != evaluations[1]  # two different models were tested
    final = checkpoint.load(run_dir)
    assert final is not None
    model_bytes = len(codec.encode(codec.join_prefixed(model=final.global_state)))
    assert [e["bytes_sent"] for e in evaluations] == [3 * model_bytes] * 2  # the model once to each evaluator

    markdown = (run_dir / "report.md").read_text()
    last = evaluations[-1]
    assert f"| {last['worst_client']} (worst) |" in markdown
    assert (run_dir / "plots" / "federated.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_counts_are_the_final_model_on_each_clients_held_out_examples(run_dir: Path) -> None:
    cfg = load_config(None, SETTINGS)
    final = checkpoint.load(run_dir)
    assert final is not None and final.completed_rounds == 3
    last = json.loads((run_dir / "report.json").read_text())["federated_evaluation"][-1]
    for cid, reported in last["per_client"].items():
        shard = client_shard(cfg, int(cid))
        train, test = local_test_split(cfg, int(cid), shard)
        assert test is not None and len(test.y) == round(0.2 * len(shard.y))  # the default fraction under "both"
        assert len(train.y) + len(test.y) == len(shard.y)
        model = model_for(cfg, num_classes=shard.num_classes, in_channels=shard.image_shape[0], image_size=shard.image_shape[1])
        model.load_state_dict(final.global_state)
        model.eval()
        y = torch.as_tensor(test.y, dtype=torch.int64)
        with torch.no_grad():
            predicted = model(images_to_tensor(test.x)).argmax(dim=1)
        assert reported["examples"] == len(y)
        assert reported["correct"] == int((predicted == y).sum()), cid
        assert reported["class_total"] == [int((y == c).sum()) for c in range(shard.num_classes)]
        assert reported["class_correct"] == [int(((y == c) & (predicted == c)).sum()) for c in range(shard.num_classes)]


# ---- counts over raw gRPC ------------------------------------------------------------------------


def receive_task(stream: Iterator[pb.ServerMessage]) -> tuple[pb.Task, dict[str, dict[str, torch.Tensor]]]:
    for message in stream:
        if message.WhichOneof("kind") == "heartbeat":
            continue
        assert message.WhichOneof("kind") == "task", message
        task = message.task
        assert task.inline_payload and task.payload.num_chunks == 0  # digits' CNN fits one chunk
        return task, codec.split_prefixed(codec.decode(task.inline_payload))
    raise AssertionError("the dispatch stream ended without a task")


def result(session: str, task: pb.Task, **changes: Any) -> pb.EvaluationResult:
    fields: dict[str, Any] = {"client_id": 0, "session": session, "round": task.round, "task_id": task.task_id, "examples": 5,
                              "correct": 3, "loss_sum": 4.0, "class_correct": [1, 2] + [0] * 8, "class_total": [2, 3] + [0] * 8}
    return pb.EvaluationResult(**{**fields, **changes})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_counts_that_do_not_add_up_are_refused_by_name_and_a_vanished_evaluator_is_left_out(tmp_path: Path) -> None:
    settings = {"data.clients": 2, "train.rounds": 1, "train.evaluation": "federated", "runtime.round_timeout_s": 120.0}
    with Runtime(tmp_path) as rt:
        coord = rt.coordinator(settings, tmp_path / "run")
        with channel(coord.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            sessions, streams, tasks = {}, {}, {}
            for k in (0, 1):  # this test plays both clients
                register = register_request(spec, client_id=k, num_samples=100, test_samples=10)
                sessions[k] = stub.Register(register, timeout=RPC_TIMEOUT_S).session
                streams[k] = stub.Subscribe(pb.SubscribeRequest(client_id=k, session=sessions[k]), timeout=240)
            for k in (0, 1):
                tasks[k] = receive_task(streams[k])
            session, (task, _) = sessions[0], tasks[0]
            assert not task.evaluate
            with pytest.raises(grpc.RpcError) as early:  # no evaluation is open before the round closes
                stub.SubmitEvaluation(result(session, task), timeout=RPC_TIMEOUT_S)
            assert early.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in early.value.details()

            for k in (0, 1):
                update = codec.encode(codec.join_prefixed(model=tasks[k][1]["model"]))
                header = pb.UpdateHeader(client_id=k, session=sessions[k], round=1, task_id=tasks[k][0].task_id, train_samples=100,
                                         payload=pb.Payload(total_bytes=len(update), sha256=codec.sha256(update)),
                                         inline_payload=update)
                assert stub.SubmitUpdate(iter([pb.UpdateChunk(header=header)]), timeout=RPC_TIMEOUT_S).accepted
            evaluation, model = receive_task(streams[0])
            assert evaluation.evaluate and evaluation.round == 1 and set(model) == {"model"}  # the model alone
            assert receive_task(streams[1])[0].evaluate
            streams[1].cancel()  # client 1 vanishes without answering: the evaluation goes on without it

            refused = [
                (result(session, evaluation, correct=6, class_correct=[2, 4] + [0] * 8), grpc.StatusCode.INVALID_ARGUMENT, "exceed"),
                (result(session, evaluation, class_total=[2, 3]), grpc.StatusCode.INVALID_ARGUMENT, "per-class correct counts"),
                (result(session, evaluation, class_correct=[1, 2], class_total=[2, 3]), grpc.StatusCode.INVALID_ARGUMENT, "10 classes"),
                (result(session, evaluation, examples=9), grpc.StatusCode.INVALID_ARGUMENT, "sum to"),
                (result(session, evaluation, task_id="0" * 16), grpc.StatusCode.FAILED_PRECONDITION, "not open"),
                (result("stale", evaluation), grpc.StatusCode.FAILED_PRECONDITION, "session is stale"),
            ]
            for message, code, words in refused:
                with pytest.raises(grpc.RpcError) as refusal:
                    stub.SubmitEvaluation(message, timeout=RPC_TIMEOUT_S)
                assert refusal.value.code() == code and words in refusal.value.details(), refusal.value.details()
            assert stub.SubmitEvaluation(result(session, evaluation), timeout=RPC_TIMEOUT_S).accepted
            with pytest.raises(grpc.RpcError) as twice:  # already answered (or, once concluded, no longer open)
                stub.SubmitEvaluation(result(session, evaluation), timeout=RPC_TIMEOUT_S)
            assert twice.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert coord.wait(60) == 0, coord.log()[-3000:]
            streams[0].cancel()
    rounds = wait_until(lambda: read_record(tmp_path / "run").get("rounds"), timeout_s=10, what="coordinator.json")
    figures = rounds[0]["federated_evaluation"]
    assert figures["sampled"] == [0, 1] and list(figures["per_client"]) == ["0"]
    assert figures["per_client"]["0"]["examples"] == 5 and figures["weighted_accuracy"] == 0.6
    assert rounds[0]["accuracy"] == 0.6  # "federated": the round's accuracy is the clients'
    assert "without clients [1]" in coord.log()
