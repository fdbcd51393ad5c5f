"""`fedsynth plan` through the real console script: JSON contract, table, plots, determinism and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsynth.allocation import fedeas_budgets, fedeas_generation, full_balance, imbalance_score

CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
COUNTS = [[120, 3, 0, 0, 40], [0, 0, 55, 0, 0], [10, 12, 9, 11, 10], [1, 0, 0, 300, 2], [30, 30, 30, 30, 30]]
REQUIRED_KEYS = {
    "policy",
    "beta",
    "counts",
    "generation",
    "client_budgets",
    "total",
    "full_balance_total",
    "imbalance_before",
    "imbalance_after",
    "synthetic_fraction",
}


def fedsynth_script() -> str:
    beside = Path(sys.executable).parent / "fedsynth"
    found = str(beside) if beside.exists() else shutil.which("fedsynth")
    assert found, "the fedsynth console script is not installed"
    return found


def plan(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [fedsynth_script(), "plan", *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def plan_json(*args: str) -> dict:
    result = plan(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture()
def counts_file(tmp_path: Path) -> Path:
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"counts": COUNTS}))
    return path


def test_json_holds_the_contract_keys_and_matches_the_library(counts_file: Path) -> None:
    out = plan_json("--counts", str(counts_file), "--beta", "12")
    assert REQUIRED_KEYS <= set(out)
    assert out["policy"] == "fedeas" and out["beta"] == 12.0 and out["counts"] == COUNTS
    assert out["generation"] == fedeas_generation(COUNTS, 12).tolist()
    assert out["client_budgets"] == fedeas_budgets(COUNTS, 12).tolist()
    assert out["client_budgets"][4] == 0  # the balanced client
    assert out["total"] == int(np.sum(out["generation"])) > 0
    assert out["full_balance_total"] == int(full_balance(COUNTS).sum())
    assert out["imbalance_before"] == pytest.approx(imbalance_score(COUNTS))
    assert out["imbalance_after"] == pytest.approx(imbalance_score(COUNTS, out["generation"]))
    assert out["synthetic_fraction"] == pytest.approx(out["total"] / (np.sum(COUNTS) + out["total"]))
    assert out["saving_vs_full_balance"] == pytest.approx(1 - out["total"] / out["full_balance_total"])


def test_matched_policies_spend_the_fedeas_total_or_the_given_budget(counts_file: Path) -> None:
    fedeas_total = plan_json("--counts", str(counts_file))["total"]
    for policy in ("uniform", "missing"):
        matched = plan_json("--counts", str(counts_file), "--policy", policy)
        assert matched["total"] == fedeas_total and matched["client_budgets"] is None
        assert plan_json("--counts", str(counts_file), "--policy", policy, "--budget", "77")["total"] == 77
    assert plan_json("--counts", str(counts_file), "--policy", "none")["generation"] == [[0] * 5] * 5
    full = plan_json("--counts", str(counts_file), "--policy", "full")
    assert full["total"] == full["full_balance_total"] and full["imbalance_after"] == pytest.approx(0.0, abs=1e-15)


def test_human_output_shows_the_table_and_the_full_balance_saving(counts_file: Path) -> None:
    result = plan("--counts", str(counts_file))
    assert result.returncode == 0, result.stderr
    out = plan_json("--counts", str(counts_file))
    assert "N_k" in result.stdout and "H~_k" in result.stdout and "classes filled" in result.stdout
    assert f"Full-Balance needs {out['full_balance_total']:,}" in result.stdout
    assert f"saving {out['saving_vs_full_balance']:.1%}" in result.stdout
    client_lines = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["4"]]
    assert client_lines[0][:5] == ["4", "150", "1.000", "0", "0"]


def test_dataset_partition_is_deterministic_by_seed() -> None:
    args = ("--dataset", "digits", "--clients", "6", "--alpha", "0.3")
    first = plan_json(*args, "--seed", "5")
    assert first == plan_json(*args, "--seed", "5")
    assert first["counts"] != plan_json(*args, "--seed", "6")["counts"]
    assert len(first["counts"]) == 6 and np.sum(first["counts"]) == 1438
    iid = plan_json("--dataset", "digits", "--clients", "4", "--partition", "iid")
    assert iid["imbalance_before"] < first["imbalance_before"]


def test_plot_writes_the_four_figures(counts_file: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "figs"
    result = plan("--counts", str(counts_file), "--plot", str(out_dir))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out_dir.glob("*.png"))
    assert names == [
        "fig1a_demand_per_client.png",
        "fig2a_cumulative_shares.png",
        "fig2b_reduction_vs_budget.png",
        "fig5b_beta_selection.png",
    ]
    for path in out_dir.glob("*.png"):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


BAD_COUNTS = [
    ('{"counts": [[3, -2]]}', "-2"),
    ('{"counts": [[3, 2.5]]}', "2.5"),
    ('{"counts": [[3, 2], [1]]}', "ragged"),
    ('{"counts": [[3, 2], [0, 0]]}', "client 1 has no samples"),
    ('{"counts": []}', "K = 0"),
    ('{"counts": [[3, 2]', "not valid JSON"),
    ('{"rows": [[3, 2]]}', '"counts"'),
]


@pytest.mark.parametrize(("text", "named"), BAD_COUNTS)
def test_bad_counts_files_fail_with_one_line_naming_the_value(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert_one_line_error(plan("--counts", str(path)), named)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--beta", "0"], "beta"),
        (["--beta", "-3"], "-3"),
        (["--policy", "uniform", "--budget", "-1"], "-1"),
        (["--policy", "fedeas", "--budget", "10"], "budget"),
        (["--seed", "1"], "--seed"),
    ],
)
def test_bad_options_with_a_counts_file_fail_cleanly(counts_file: Path, args: list[str], named: str) -> None:
    assert_one_line_error(plan("--counts", str(counts_file), *args), named)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--dataset", "digits", "--alpha", "0"], "alpha"),
        (["--dataset", "digits", "--alpha", "-0.5"], "-0.5"),
        (["--dataset", "digits", "--clients", "0"], "clients"),
        (["--dataset", "mnist"], "'mnist'"),
        (["--dataset", "cifar10", "--data-dir", "/no/such/folder"], "/no/such/folder"),
        (["--counts", "/no/such/counts.json"], "/no/such/counts.json"),
        ([], "--counts"),
    ],
)
def test_bad_inputs_fail_with_one_line_naming_the_value(args: list[str], named: str) -> None:
    assert_one_line_error(plan(*args), named)


def test_unknown_policy_is_an_argparse_usage_error(counts_file: Path) -> None:
    result = plan("--counts", str(counts_file), "--policy", "greedy")
    assert result.returncode == 2 and "'greedy'" in result.stderr and "Traceback" not in result.stderr


def assert_one_line_error(result: subprocess.CompletedProcess[str], named: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedsynth plan: error:"), result.stderr
    assert named in lines[0]


@pytest.mark.shared_data
def test_cifar10_k20_alpha01_plan_is_consistent() -> None:
    assert (CIFAR10 / "train.npz").is_file(), f"this shared_data test needs CIFAR-10 at {CIFAR10}"
    out = plan_json(
        "--dataset",
        "cifar10",
        "--data-dir",
        str(CIFAR10),
        "--clients",
        "20",
        "--alpha",
        "0.1",
        "--seed",
        "0",
        "--beta",
        "12",
    )
    counts, generation = np.array(out["counts"]), np.array(out["generation"])
    assert counts.shape == (20, 10) and counts.sum() == 50_000 and counts.sum(axis=1).min() >= 10
    assert generation.sum() == out["total"] == sum(out["client_totals"])
    assert np.array_equal(generation, fedeas_generation(counts, 12))
    assert out["full_balance_total"] > 10 * out["total"]  # the paper: 226,783 vs 13,437
    assert 0.2 < out["imbalance_removed"] < 0.8 and 0.05 < out["synthetic_fraction"] < 0.4
    assert out["selected_beta"] is not None
