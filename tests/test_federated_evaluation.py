"""Federated evaluation's plain parts: the round's figures from client counts, the counts of a model, a client's local
test split, the config keys (bad values: one line naming the key, exit 1) and the Prometheus gauges."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from fedsynth.assembly import client_shard, local_test_split
from fedsynth.config import RunConfig, load_config
from fedsynth.errors import ConfigError
from fedsynth.learning.evaluation import EvaluationCounts, count_predictions, held_out_indices, summarize_round
from fedsynth.learning.training import TrainData


def counts(class_correct: list[int], class_total: list[int], loss_sum: float = 1.0) -> EvaluationCounts:
    return EvaluationCounts(sum(class_total), sum(class_correct), loss_sum, tuple(class_correct), tuple(class_total))


# ---- the round's figures -------------------------------------------------------------------------


def test_summary_of_three_clients_matches_the_hand_computation() -> None:
    # client 4: 9/10 correct; client 7: 1/4; client 9: 30/40 (three classes)
    reported = {
        9: counts([10, 20, 0], [10, 20, 10], loss_sum=12.0),
        4: counts([5, 4, 0], [5, 5, 0], loss_sum=2.0),
        7: counts([0, 0, 1], [0, 2, 2], loss_sum=6.0),
    }
    figures = summarize_round(5, reported, sampled=[9, 4, 7, 2])
    assert figures["round"] == 5 and figures["sampled"] == [2, 4, 7, 9] and figures["clients"] == 3
    assert figures["examples"] == 54
    assert figures["weighted_accuracy"] == pytest.approx(40 / 54)  # by test examples, not by a mean of ratios
    assert figures["mean_accuracy"] == pytest.approx((0.9 + 0.25 + 0.75) / 3)
    assert figures["worst_accuracy"] == 0.25 and figures["worst_client"] == 7
    assert figures["best_accuracy"] == 0.9 and figures["spread"] == pytest.approx(0.65)
    # 10th percentile of [0.25, 0.75, 0.9], linear: position 0.1 * 2 = 0.2 -> 0.25 + 0.2 * 0.5
    assert figures["p10_accuracy"] == pytest.approx(0.35)
    assert figures["loss"] == pytest.approx(20.0 / 54)
    assert figures["per_class_recall"] == pytest.approx([15 / 15, 24 / 27, 1 / 12])
    assert figures["per_client"]["7"] == {"accuracy": 0.25, "examples": 4, "correct": 1, "loss_sum": 6.0,
                                          "class_correct": [0, 0, 1], "class_total": [0, 2, 2]}


def test_a_class_no_client_holds_has_no_recall_and_an_empty_client_is_not_ranked() -> None:
    figures = summarize_round(1, {0: counts([2, 0], [4, 0]), 1: counts([0, 0], [0, 0], loss_sum=0.0)}, sampled=[0, 1])
    assert figures["per_class_recall"] == [0.5, None]
    assert figures["per_client"]["1"]["accuracy"] is None and figures["per_client"]["1"]["examples"] == 0
    assert figures["worst_client"] == 0 and figures["mean_accuracy"] == 0.5


def test_ties_name_the_lower_client_and_no_answers_give_no_figures() -> None:
    assert summarize_round(1, {3: counts([1], [2]), 2: counts([2], [4])}, sampled=[2, 3])["worst_client"] == 2
    empty = summarize_round(1, {}, sampled=[0])
    assert empty["weighted_accuracy"] is None and empty["worst_client"] is None and empty["per_class_recall"] == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ((3, 4, 1.0, (4,), (3,)), "exceed"),
        ((3, 1, 1.0, (1, 0), (3,)), "per-class correct counts for"),
        ((4, 1, 1.0, (1,), (3,)), "sum to"),
        ((3, 1, float("nan"), (1,), (3,)), "loss_sum"),
        ((3, 1, -1.0, (1,), (3,)), "loss_sum"),
    ],
)
def test_inconsistent_counts_are_refused(fields: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvaluationCounts(*fields)


def test_counts_of_a_model_are_its_predictions_counted_by_class() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x, y = torch.randn(50, 1, 2, 2), torch.randint(0, 3, (50,))
    got = count_predictions(model, TrainData(x, y), num_classes=3, batch_size=7)
    with torch.no_grad():
        logits = model(x)
    predicted = logits.argmax(dim=1)
    assert got.class_total == tuple(int((y == c).sum()) for c in range(3))
    assert got.class_correct == tuple(int(((y == c) & (predicted == c)).sum()) for c in range(3))
    assert got.loss_sum == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")), rel=1e-5)


# ---- a client's local test set -------------------------------------------------------------------


def test_held_out_indices_are_seeded_disjoint_and_sized() -> None:
    train, test = held_out_indices(101, 0.2, seed=5)
    assert len(test) == 20 and len(train) == 81
    assert sorted([*train, *test]) == list(range(101)) and list(test) == sorted(test)
    again = held_out_indices(101, 0.2, seed=5)
    assert np.array_equal(again[1], test) and not np.array_equal(held_out_indices(101, 0.2, seed=6)[1], test)
    assert len(held_out_indices(3, 0.01, seed=0)[1]) == 1 and len(held_out_indices(3, 0.99, seed=0)[0]) == 1
    assert len(held_out_indices(1, 0.5, seed=0)[1]) == 0


def test_server_evaluation_keeps_every_shard_bit_for_bit() -> None:
    cfg = RunConfig()
    shard = client_shard(cfg, 2)
    train, test = local_test_split(cfg, 2, shard)
    assert train is shard and test is None


def test_federated_evaluation_holds_out_a_fifth_by_default_and_the_set_fraction_otherwise() -> None:
    for overrides, fraction in ((["train.evaluation=federated"], 0.2), (["train.evaluation=both", "data.local_test_fraction=0.5"], 0.5),
                                (["data.local_test_fraction=0.3"], 0.3)):
        cfg = load_config(None, overrides)
        shard = client_shard(cfg, 1)
        train, test = local_test_split(cfg, 1, shard)
        assert test is not None and len(test.y) == round(fraction * len(shard.y)), overrides
        assert len(train.y) + len(test.y) == len(shard.y)
        rows = {row.tobytes() for row in shard.x.reshape(len(shard.x), -1)}
        assert all(row.tobytes() in rows for row in test.x.reshape(len(test.x), -1))
        again = local_test_split(cfg, 1, shard)[1]
        assert again is not None and np.array_equal(again.x, test.x)  # seeded: every node holds out the same examples


# ---- the config keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.evaluation=sometimes", "train.evaluation"),
        ("train.evaluation=1", "train.evaluation"),
        ("train.eval_every=0", "train.eval_every"),
        ("train.eval_every=1.5", "train.eval_every"),
        ("train.fraction_evaluate=0", "train.fraction_evaluate"),
        ("train.fraction_evaluate=1.5", "train.fraction_evaluate"),
        ("data.local_test_fraction=1.0", "data.local_test_fraction"),
        ("data.local_test_fraction=-0.1", "data.local_test_fraction"),
        ("data.local_test_fraction=nan", "data.local_test_fraction"),
    ],
)
def test_a_bad_evaluation_key_is_refused(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_the_cli_refuses_a_bad_evaluation_key_in_one_line_before_any_process(tmp_path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--set", "train.evaluation=sometimes", "--set",
                           f"out_dir={out}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.evaluation" in lines[0] and "sometimes" in lines[0], done.stderr
    assert not out.exists()


def test_the_new_keys_at_their_defaults_keep_old_fingerprints() -> None:
    default = RunConfig().fingerprint()
    assert load_config(None, ["train.evaluation='server'", "train.eval_every=1", "train.fraction_evaluate=1.0",
                              "data.local_test_fraction=0.0"]).fingerprint() == default
    assert load_config(None, ["train.evaluation=both"]).fingerprint() != default  # its clients train on 80% of their shard
    assert load_config(None, ["data.local_test_fraction=0.1"]).fingerprint() != default


# ---- Prometheus ----------------------------------------------------------------------------------


def test_federated_gauges_follow_the_last_evaluated_round() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    figures = summarize_round(2, {0: counts([3, 1], [4, 4]), 1: counts([1, 0], [2, 0])}, sampled=[0, 1])
    summary = {"round": 2, "duration_s": 1.0, "phases_s": {}, "participants": [0, 1], "accuracy": None, "loss": None,
               "federated_evaluation": figures}
    metrics.observe_round(summary)

    def value(statistic: str) -> float | None:
        return registry.get_sample_value("fedsynth_coordinator_federated_accuracy", {"statistic": statistic})

    assert value("weighted") == pytest.approx(5 / 10)
    assert value("mean") == pytest.approx((0.5 + 0.5) / 2)
    assert value("worst") == pytest.approx(0.5) and value("p10") == pytest.approx(0.5)
    assert registry.get_sample_value("fedsynth_coordinator_federated_clients_evaluated") == 2
    assert registry.get_sample_value("fedsynth_coordinator_global_accuracy") == 0.0  # a round nobody tested sets nothing
