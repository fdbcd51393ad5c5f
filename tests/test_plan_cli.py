"""`fedsynth plan` through the real console script: JSON contract, table, plots, determinism and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import allocation_reference as reference
from fedsynth.allocation import fedeas_budgets, fedeas_generation

CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
COUNTS = [[120, 3, 0, 0, 40], [0, 0, 55, 0, 0], [10, 12, 9, 11, 10], [1, 0, 0, 300, 2], [30, 30, 30, 30, 30]]
# Worked by hand with C = 4: each N_k / C is a square and H_k / ln C is 0, 1/2 (two equal classes: ln 2 / ln 4) or 1.
# b_k = floor(sqrt(N_k / 4) * (1 - H_k / ln 4) * 12): 2 * 1 * 12 = 24, 4 * 1/2 * 12 = 24, 0 (balanced), 5 * 1 * 12 = 60.
HAND = [[16, 0, 0, 0], [32, 32, 0, 0], [9, 9, 9, 9], [0, 0, 0, 100]]
HAND_BUDGETS = [24, 24, 0, 60]
HAND_GENERATION = [[8, 24, 24, 24], [0, 0, 24, 24], [0, 0, 0, 0], [60, 60, 60, 0]]  # max(0, b_k - n_k^c): 308 images
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


@pytest.fixture()
def hand_file(tmp_path: Path) -> Path:
    path = tmp_path / "hand.json"
    path.write_text(json.dumps({"counts": HAND}))
    return path


def test_json_holds_the_contract_keys_and_the_hand_computed_plan(hand_file: Path) -> None:
    out = plan_json("--counts", str(hand_file), "--beta", "12")
    assert REQUIRED_KEYS <= set(out)
    assert out["policy"] == "fedeas" and out["beta"] == 12.0 and out["counts"] == HAND
    assert out["client_budgets"] == HAND_BUDGETS
    assert out["generation"] == HAND_GENERATION
    assert out["client_totals"] == [80, 48, 0, 180] and out["total"] == 308
    assert out["full_balance_total"] == 412  # (16-n) over client 0, (32-n) over client 1, (100-n) over client 3
    # I = sum_k p_k ||q_k - u||^2: ||q_k - u||^2 is 3/4 for one class, 1/4 for two equal ones, so (12 + 16 + 75) / 216.
    assert out["imbalance_before"] == pytest.approx(103 / 216, rel=1e-12)
    # After: client 0 is balanced; client 1 [32, 32, 24, 24] has 1/196 at weight 112, client 3 [60, 60, 60, 100] has
    # 3/196 at weight 280, out of 524 images in all: (112 + 840) / 196 / 524 = 17 / 1834.
    assert out["imbalance_after"] == pytest.approx(17 / 1834, rel=1e-12)
    assert out["imbalance_removed"] == pytest.approx(1 - (17 / 1834) / (103 / 216), rel=1e-12)
    assert out["synthetic_fraction"] == pytest.approx(308 / 524, rel=1e-12)
    assert out["saving_vs_full_balance"] == pytest.approx(1 - 308 / 412, rel=1e-12)
    assert out["selected_beta"] == reference.selected_beta(HAND) == 2.0


def test_matched_policies_spread_the_fedeas_total_by_the_remainder_rule(hand_file: Path) -> None:
    # B = 308. Uniform: 16 pairs, 308 = 16 * 19 + 4, so client 0's four pairs get 20. Missing-only: the 8 absent
    # pairs (client 0: classes 1-3, client 1: 2-3, client 3: 0-2), 308 = 8 * 38 + 4: the first four get 39.
    uniform = plan_json("--counts", str(hand_file), "--policy", "uniform")
    assert uniform["generation"] == [[20] * 4, [19] * 4, [19] * 4, [19] * 4] and uniform["client_budgets"] is None
    missing = plan_json("--counts", str(hand_file), "--policy", "missing")
    assert missing["generation"] == [[0, 39, 39, 39], [0, 0, 39, 38], [0, 0, 0, 0], [38, 38, 38, 0]]
    assert missing["client_budgets"] is None
    # --budget 77 = 8 * 9 + 5 over the absent pairs; 77 = 16 * 4 + 13 over all of them.
    given = plan_json("--counts", str(hand_file), "--policy", "missing", "--budget", "77")
    assert given["generation"] == [[0, 10, 10, 10], [0, 0, 10, 10], [0, 0, 0, 0], [9, 9, 9, 0]]
    given = plan_json("--counts", str(hand_file), "--policy", "uniform", "--budget", "77")
    assert given["generation"] == [[5] * 4, [5] * 4, [5] * 4, [5, 4, 4, 4]]
    assert plan_json("--counts", str(hand_file), "--policy", "none")["generation"] == [[0] * 4] * 4
    full = plan_json("--counts", str(hand_file), "--policy", "full")
    assert full["generation"] == [[0, 16, 16, 16], [0, 0, 32, 32], [0, 0, 0, 0], [100, 100, 100, 0]]
    assert full["total"] == full["full_balance_total"] == 412 and full["imbalance_after"] == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(
    ("flags", "beta", "rule"),
    [
        (["--no-entropy-factor"], 12.0, {"exponent": 0.5, "entropy_factor": False}),
        (["--exponent", "1.0", "--beta", "8"], 8.0, {"exponent": 1.0, "entropy_factor": True}),
        (["--exponent", "1", "--beta", "8", "--no-entropy-factor"], 8.0, {"exponent": 1.0, "entropy_factor": False}),
    ],
)
def test_ablation_flags_give_the_librarys_budgets_exactly(counts_file: Path, flags: list[str], beta: float, rule: dict) -> None:
    out = plan_json("--counts", str(counts_file), *flags)
    assert out["beta"] == beta and out["exponent"] == rule["exponent"] and out["entropy_factor"] is rule["entropy_factor"]
    assert out["client_budgets"] == fedeas_budgets(COUNTS, beta, **rule).tolist()
    assert out["client_budgets"] == [reference.fedeas_budget(row, beta, **rule) for row in COUNTS]
    assert out["generation"] == fedeas_generation(COUNTS, beta, **rule).tolist() == reference.fedeas(COUNTS, beta, **rule)
    paper = plan_json("--counts", str(counts_file), "--beta", str(beta))
    assert paper["exponent"] == 0.5 and paper["entropy_factor"] is True
    assert out["client_budgets"] != paper["client_budgets"]  # the switch changes the plan
    # the matched baselines spend the ablated FedEAS total
    uniform = plan_json("--counts", str(counts_file), "--policy", "uniform", *flags)
    total = sum(map(sum, reference.fedeas(COUNTS, beta, **rule)))
    assert uniform["total"] == total == out["total"]
    assert uniform["generation"] == reference.matched(COUNTS, total, missing_only=False)


def test_ablation_flags_on_a_dataset_partition_equal_the_library() -> None:
    out = plan_json("--dataset", "digits", "--clients", "6", "--seed", "2", "--exponent", "1.0", "--beta", "8",
                    "--no-entropy-factor")
    assert out["client_budgets"] == fedeas_budgets(out["counts"], 8, exponent=1.0, entropy_factor=False).tolist()
    assert out["generation"] == reference.fedeas(out["counts"], 8, exponent=1.0, entropy_factor=False)
    table = plan("--dataset", "digits", "--clients", "6", "--seed", "2", "--exponent", "1.0", "--beta", "8",
                 "--no-entropy-factor")
    assert table.returncode == 0 and "exponent 1, no entropy factor" in table.stdout.splitlines()[0]


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
        (["--exponent", "-1"], "--exponent"),
        (["--exponent", "nan"], "nan"),
        (["--exponent", "2.5"], "2.5"),
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
    counts = out["counts"]
    assert np.array(counts).shape == (20, 10) and np.sum(counts) == 50_000 and min(map(sum, counts)) >= 10
    expected = reference.fedeas(counts, 12)
    assert out["generation"] == expected
    assert out["client_budgets"] == [reference.fedeas_budget(row, 12) for row in counts]
    assert out["total"] == sum(map(sum, expected)) == sum(out["client_totals"])
    assert out["full_balance_total"] == sum(map(sum, reference.full_balance(counts)))
    before, after = reference.imbalance(counts), reference.imbalance(counts, expected)
    assert out["imbalance_before"] == pytest.approx(before, rel=1e-9)
    assert out["imbalance_after"] == pytest.approx(after, rel=1e-9)
    assert out["imbalance_removed"] == pytest.approx(1 - after / before, rel=1e-9)
    assert out["synthetic_fraction"] == pytest.approx(out["total"] / (50_000 + out["total"]), rel=1e-12)
    assert out["selected_beta"] == reference.selected_beta(counts)
