"""FedEAS end to end through `fedsynth run`: generation totals match `fedsynth plan`, matched baselines spend B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedsynth.allocation import generation_matrix
from fedsynth.config import load_config
from fedsynth.data import load_labels
from fedsynth.partition import label_counts, partition

RUN = [
    "data.clients=4", "train.rounds=2", "train.local_epochs=1", "runtime.clients_per_process=4",
    "generation.beta=12.0", "seed=3",
]


def _run(tmp_path: Path, model: Path, policy: str) -> dict:
    out = tmp_path / policy
    sets = [*RUN, f"generation.policy={policy}", f"generation.model_dir={json.dumps(str(model))}"]
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _planned(policy: str) -> tuple[int, dict[str, int]]:
    cfg = load_config(None, RUN)
    labels = load_labels("digits")
    counts = label_counts(labels, partition(labels, 4, alpha=cfg.data.alpha, seed=cfg.seed, min_size=cfg.data.min_size), 10)
    matrix = generation_matrix(policy, counts, beta=cfg.generation.beta)
    fedeas_total = int(generation_matrix("fedeas", counts, beta=cfg.generation.beta).sum())
    assert int(matrix.sum()) == fedeas_total  # the matched-budget protocol: every policy spends the FedEAS total
    return int(matrix.sum()), {str(k): int(v) for k, v in enumerate(matrix.sum(axis=1))}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fedeas", "uniform", "missing"])
def test_run_generates_exactly_the_planned_images(tmp_path: Path, tiny_generator: Path, policy: str) -> None:
    report = _run(tmp_path, tiny_generator, policy)
    total, per_client = _planned(policy)
    plan = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "plan", "--dataset", "digits", "--clients", "4", "--alpha", "0.1", "--seed", "3",
         "--policy", policy, "--beta", "12", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert json.loads(plan.stdout)["total"] == total
    generation = report["generation"]
    assert generation["total_images"] == total > 0
    assert generation["per_client"] == per_client
    assert generation["generator"]["images_total"] == total  # the generator's own Prometheus counter agrees
    assert generation["device_seconds"] > 0
    assert report["success"] and len(report["rounds"]) == 2
