"""FedEAS end to end through `fedsynth run`: each client generates, per class, exactly what DESIGN.md's formulas give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import allocation_reference as reference
from fedsynth.config import load_config
from fedsynth.learning.data import load_labels
from fedsynth.learning.partition import label_counts, partition

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


def _expected(policy: str) -> list[list[int]]:
    """Images per (client, class) for the run's partition, from the formulas (the planner is not consulted)."""
    cfg = load_config(None, RUN)
    labels = load_labels("digits")
    parts = partition(labels, 4, alpha=cfg.data.alpha, seed=cfg.seed, min_size=cfg.data.min_size)
    counts = label_counts(labels, parts, 10).tolist()
    fedeas = reference.fedeas(counts, cfg.generation.beta)
    if policy == "fedeas":
        return fedeas
    return reference.matched(counts, sum(map(sum, fedeas)), missing_only=policy == "missing")  # B = the FedEAS total


def _cached(out: Path, client: int) -> list[int]:
    """Images per class in the client's synthetic cache: what it received from the generator and trains on."""
    manifest = out / "cache" / f"client-{client:04d}" / "manifest.json"
    if not manifest.is_file():  # a client with nothing to generate never opens a cache
        return [0] * 10
    parts = json.loads(manifest.read_text())["parts"]
    return [sum(part["count"] for part in parts[str(c)]) for c in range(10)]


@pytest.mark.slow
# the matched Uniform arm runs end to end in test_fedeas_ablation_e2e (same matched-budget rule, per-client totals)
@pytest.mark.parametrize("policy", ["fedeas", "missing"])
def test_run_generates_exactly_the_planned_images(tmp_path: Path, tiny_generator: Path, policy: str) -> None:
    report = _run(tmp_path, tiny_generator, policy)
    expected = _expected(policy)
    totals = [sum(row) for row in expected]
    assert sum(totals) > 0
    assert report["success"] and len(report["rounds"]) == 2
    assert [_cached(tmp_path / policy, k) for k in range(4)] == expected
    generation = report["generation"]
    assert generation["per_client"] == {str(k): total for k, total in enumerate(totals)}
    assert generation["total_images"] == sum(totals)
    assert generation["generator"]["images_total"] == sum(totals)  # the generator's own Prometheus counter agrees
    assert generation["device_seconds"] > 0
    plan = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "plan", "--dataset", "digits", "--clients", "4", "--alpha", "0.1", "--seed", "3",
         "--policy", policy, "--beta", "12", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert json.loads(plan.stdout)["generation"] == expected  # the planner shows a user what the run will generate
