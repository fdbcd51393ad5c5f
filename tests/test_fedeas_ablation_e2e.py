"""The paper's ablations (Table 2) end to end: `fedsynth run` with generation.exponent = 1.0 and
generation.entropy_factor = false generates, per client, exactly what `fedsynth plan --exponent 1.0
--no-entropy-factor` and the formulas give; the matched Uniform baseline spends that ablated FedEAS total."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import allocation_reference as reference
from fedsynth.learning.data import load_labels
from fedsynth.learning.partition import label_counts, partition

CLIENTS, SEED, BETA, HOLDOUT, ALPHA = 3, 5, 2.0, 0.2, 0.1
RUN = [
    f"data.clients={CLIENTS}", f"seed={SEED}", f"data.holdout_fraction={HOLDOUT}", "generation.backend=holdout",
    "train.rounds=1", "train.local_epochs=1", f"runtime.clients_per_process={CLIENTS}",
    f"generation.beta={BETA}", "generation.exponent=1.0", "generation.entropy_factor=false",
]


def _expected(policy: str) -> list[list[int]]:
    """Images per (client, class) from the formulas on the run's own partition (the planner is not consulted)."""
    labels = load_labels("digits")
    parts = partition(labels, CLIENTS, alpha=ALPHA, seed=SEED, min_size=10, holdout_fraction=HOLDOUT)
    counts = label_counts(labels, parts, 10).tolist()
    fedeas = reference.fedeas(counts, BETA, exponent=1.0, entropy_factor=False)
    if policy == "fedeas":
        return fedeas
    return reference.matched(counts, sum(map(sum, fedeas)), missing_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fedeas", "uniform"])
def test_an_ablated_run_generates_what_the_ablated_plan_says(tmp_path: Path, policy: str) -> None:
    out = tmp_path / policy
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in [*RUN, f"generation.policy={policy}"]:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())

    plan = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "plan", "--dataset", "digits", "--clients", str(CLIENTS), "--alpha",
         str(ALPHA), "--seed", str(SEED), "--holdout-fraction", str(HOLDOUT), "--policy", policy, "--beta", str(BETA),
         "--exponent", "1.0", "--no-entropy-factor", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    planned = json.loads(plan.stdout)
    expected = _expected(policy)
    assert planned["generation"] == expected
    assert report["success"] and report["config"]["generation"]["exponent"] == 1.0
    assert report["generation"]["per_client"] == {str(k): total for k, total in enumerate(planned["client_totals"])}
    assert report["generation"]["total_images"] == planned["total"] == sum(map(sum, expected))
    paper = sum(map(sum, reference.fedeas(planned["counts"], BETA)))  # 45 images at the paper's rule
    assert planned["total"] > 10 * paper  # 1315: the run followed the switches, not the paper's rule
