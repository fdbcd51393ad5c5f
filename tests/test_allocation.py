"""Hand-checked FedEAS budgets, matched baselines, the imbalance score, its gain, paths and input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsynth.allocation import (
    BetaPoint,
    assigned_quota,
    beta_path,
    client_quota,
    fedeas_budgets,
    fedeas_client_budget,
    fedeas_generation,
    fedeas_generation_row,
    first_order_gain,
    full_balance,
    generation_matrix,
    greedy_path,
    imbalance_decomposition,
    imbalance_score,
    matched_quota,
    normalized_entropy,
    select_beta,
    synthetic_fraction,
    validate_counts,
)
from fedsynth.errors import ConfigError, DataError

SKEWED = np.array(
    [
        [120, 3, 0, 0, 40],
        [0, 0, 55, 0, 0],
        [10, 12, 9, 11, 10],
        [1, 0, 0, 300, 2],
        [30, 30, 30, 30, 30],
    ]
)


def random_counts(seed: int, clients: int = 8, classes: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(clients, classes)) * (rng.random((clients, classes)) < 0.6)
    counts[:, 0] += 1  # no empty client
    return counts


# --- FedEAS budget and generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [[7] * 10, [1, 1, 1], [1000] * 100, [3] * 7, [50, 50]])
def test_balanced_client_gets_zero_budget_and_generates_nothing(row: list[int]) -> None:
    assert normalized_entropy(row) == 1.0
    assert fedeas_client_budget(row, 1e6) == 0
    assert fedeas_generation_row(row, 1e6).tolist() == [0] * len(row)


@pytest.mark.parametrize(
    ("size", "classes", "beta", "expected"), [(40, 10, 12, 24), (90, 10, 12, 36), (50, 10, 12, 26)]
)
def test_single_class_client_gets_floor_sqrt_mean_times_beta(
    size: int, classes: int, beta: float, expected: int
) -> None:
    row = [0] * classes
    row[3] = size
    assert expected == math.floor(math.sqrt(size / classes) * beta)
    assert fedeas_client_budget(row, beta) == expected
    generation = fedeas_generation_row(row, beta)
    assert generation.dtype == np.int64
    assert generation.tolist() == [expected if c != 3 else max(0, expected - size) for c in range(classes)]


def test_budget_of_a_skewed_two_class_client_matches_the_formula_by_hand() -> None:
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # counts (3, 1)
    pre_floor = math.sqrt(4 / 2) * (1 - entropy / math.log(2)) * 12  # = 3.203
    assert 3 < pre_floor < 4
    assert fedeas_client_budget([3, 1], 12) == 3
    assert fedeas_generation_row([3, 1], 12).tolist() == [0, 2]


def test_a_pre_floor_budget_below_one_gives_zero() -> None:
    assert fedeas_client_budget([3, 1], 1.0) == 0  # 0.267 before the floor
    assert fedeas_generation_row([3, 1], 1.0).tolist() == [0, 0]


def test_ablation_variants() -> None:
    single = [40] + [0] * 9
    assert fedeas_client_budget(single, 12, exponent=1.0) == 48  # linear: n_bar = 4
    assert fedeas_client_budget(single, 12, exponent=0.25) == math.floor(4**0.25 * 12)
    balanced = [10] * 10
    assert fedeas_client_budget(balanced, 12, entropy_factor=False) == math.floor(math.sqrt(10) * 12)
    assert fedeas_generation_row(balanced, 12, entropy_factor=False).tolist() == [27] * 10


def test_matrix_rows_equal_what_each_client_computes_alone() -> None:
    counts = random_counts(1)
    matrix = fedeas_generation(counts, 12)
    for k, row in enumerate(counts):
        assert matrix[k].tolist() == fedeas_generation_row(row, 12).tolist()
        assert fedeas_budgets(counts, 12)[k] == fedeas_client_budget(row, 12)
    assert np.array_equal(generation_matrix("fedeas", counts, beta=12), matrix)


# --- baselines ------------------------------------------------------------------------------------------------


def test_uniform_spends_exactly_b_with_the_remainder_in_row_major_order() -> None:
    counts = np.ones((3, 4), dtype=np.int64)
    quota = matched_quota("uniform", counts, 14)  # 12 pairs: 1 each, then +1 to (0,0) and (0,1)
    assert quota.tolist() == [[2, 2, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert matched_quota("uniform", counts, 7).tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]]
    for total in (0, 1, 11, 12, 13, 1000):
        assert matched_quota("uniform", SKEWED, total).sum() == total


def test_missing_only_spends_exactly_b_on_absent_pairs_in_row_major_order() -> None:
    counts = np.array([[5, 0, 0], [0, 4, 4], [2, 2, 2]])
    assert matched_quota("missing", counts, 7).tolist() == [[0, 3, 2], [2, 0, 0], [0, 0, 0]]
    for total in (0, 1, 5, 999):
        quota = matched_quota("missing", SKEWED, total)
        assert quota.sum() == total
        assert np.all(quota[SKEWED > 0] == 0)


def test_missing_only_refuses_a_budget_when_no_pair_is_absent() -> None:
    with pytest.raises(DataError, match="absent"):
        matched_quota("missing", [[1, 2], [3, 4]], 5)
    assert matched_quota("missing", [[1, 2], [3, 4]], 0).tolist() == [[0, 0], [0, 0]]


def test_matched_baselines_default_to_the_fedeas_total_and_budget_overrides_it() -> None:
    fedeas_total = int(fedeas_generation(SKEWED, 12).sum())
    assert fedeas_total > 0
    for policy in ("uniform", "missing"):
        assert generation_matrix(policy, SKEWED, beta=12).sum() == fedeas_total
        assert generation_matrix(policy, SKEWED, beta=12, budget=123).sum() == 123


def test_full_balance_fills_every_class_to_the_largest_and_none_is_zero() -> None:
    counts = [[5, 0, 2], [1, 1, 1]]
    assert full_balance(counts).tolist() == [[0, 5, 3], [0, 0, 0]]
    assert generation_matrix("full", counts, beta=12).tolist() == [[0, 5, 3], [0, 0, 0]]
    assert generation_matrix("none", counts, beta=12).tolist() == [[0, 0, 0], [0, 0, 0]]



def test_coordinator_sees_only_absence_yet_assigns_what_the_planner_plans() -> None:
    # At registration a client reveals its FedEAS total and (for missing-only) its absent classes, not its counts.
    missing = {k: np.flatnonzero(row == 0).tolist() for k, row in enumerate(SKEWED)}
    totals = [int(fedeas_generation_row(row, 12).sum()) for row in SKEWED]
    for policy in ("uniform", "missing"):
        assigned = assigned_quota(policy, SKEWED.shape, missing=missing, fedeas_totals=totals)
        assert assigned is not None
        assert np.array_equal(assigned, matched_quota(policy, SKEWED, sum(totals)))
        assert np.array_equal(generation_matrix(policy, SKEWED, beta=12), assigned)
        rows = [client_quota(policy, row, beta=12, assigned=assigned[k]) for k, row in enumerate(SKEWED)]
        assert np.array_equal(np.stack(rows), assigned)
    budget = assigned_quota("missing", SKEWED.shape, missing=missing, fedeas_totals=totals, budget=7)
    # 8 absent pairs, 7 images: one each to the first 7 in row-major order; client 3's class 2 gets none.
    assert budget is not None and budget.tolist() == [[0, 0, 1, 1, 0], [1, 1, 0, 1, 1], [0] * 5, [0, 1, 0, 0, 0], [0] * 5]
    assert assigned_quota("fedeas", SKEWED.shape, missing=missing, fedeas_totals=totals) is None


def test_each_client_computes_its_own_row_of_the_plan() -> None:
    for policy in ("none", "fedeas", "full"):
        matrix = generation_matrix(policy, SKEWED, beta=12)
        for k, row in enumerate(SKEWED):
            assert client_quota(policy, row, beta=12).tolist() == matrix[k].tolist()
    assert client_quota("full", [5, 0, 2], beta=12).tolist() == [0, 5, 3]
    assert client_quota("fedeas", [3, 1], beta=12).tolist() == [0, 2]
    with pytest.raises(DataError, match="assigned row of 5 classes, got 4 classes"):
        client_quota("uniform", SKEWED[0], beta=12, assigned=[1, 2, 3, 4])
    with pytest.raises(DataError, match="got none"):
        client_quota("missing", SKEWED[0], beta=12)


# --- imbalance score and gain -----------------------------------------------------------------------------------


def test_imbalance_score_by_hand() -> None:
    counts = [[2, 0], [1, 1]]  # p = (1/2, 1/2); ||q_0 - u||^2 = 1/2; client 1 is balanced
    assert imbalance_score(counts) == pytest.approx(0.25)
    assert imbalance_score(counts, [[0, 2], [0, 0]]) == pytest.approx(0.0)
    # client 0 becomes (2, 1): ||q - u||^2 = 1/18; p_0 = 3/5 from augmented sizes, 1/2 from the original ones
    assert imbalance_score(counts, [[0, 1], [0, 0]]) == pytest.approx(3 / 5 / 18)
    assert imbalance_score(counts, [[0, 1], [0, 0]], weights="original") == pytest.approx(1 / 2 / 18)
    assert synthetic_fraction(counts, [[0, 1], [0, 1]]) == pytest.approx(2 / 6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decomposition_identity(seed: int) -> None:
    counts = random_counts(seed)
    parts = imbalance_decomposition(counts)
    assert parts.between > 1e-4  # the pooled labels are skewed, so both terms matter
    assert parts.total == pytest.approx(imbalance_score(counts), rel=1e-12)
    assert parts.total == pytest.approx(parts.within + parts.between, rel=1e-12)


def test_gain_matches_a_finite_difference_of_the_score() -> None:
    counts = SKEWED
    gain = first_order_gain(counts)
    eps = 1e-5
    before = imbalance_score(counts, weights="original")
    for k in range(counts.shape[0]):
        for c in range(counts.shape[1]):
            bump = np.zeros(counts.shape)
            bump[k, c] = eps
            finite = (before - imbalance_score(counts, bump, weights="original")) / eps
            assert finite == pytest.approx(gain[k, c], rel=1e-3, abs=1e-9)
    assert gain[0, 0] < 0 < gain[0, 2]  # more of a dominant class (q^c > ||q||^2) makes it worse; a gap helps
    assert gain[1, 2] == 0 < gain[1, 0]  # a one-class client: its own class is neutral to first order
    assert np.allclose(gain[4], 0.0)  # balanced client: no first-order effect


def test_greedy_path_first_step_is_the_argmax_of_the_gain_and_bookkeeping_is_exact() -> None:
    counts = random_counts(3)
    path = greedy_path(counts, 300)
    first = np.unravel_index(np.argmax(first_order_gain(counts)), counts.shape)
    assert tuple(path.picks[0]) == tuple(int(i) for i in first)
    assert path.generation.sum() == 300 and len(path.imbalance) == 301
    replay = np.zeros_like(counts)
    for step, (k, c) in enumerate(path.picks, start=1):
        replay[k, c] += 1
        if step in (1, 50, 300):
            assert path.imbalance[step] == pytest.approx(imbalance_score(counts, replay), rel=1e-9)
    assert np.array_equal(replay, path.generation)
    after_first = counts.copy()
    after_first[tuple(path.picks[0])] += 1  # the gain is recomputed after every step
    second = np.unravel_index(np.argmax(first_order_gain(after_first)), counts.shape)
    assert tuple(path.picks[1]) == tuple(int(i) for i in second)


def test_greedy_path_stops_when_every_client_is_balanced() -> None:
    path = greedy_path([[4, 4], [2, 2]], 10)
    assert len(path.picks) == 0 and path.imbalance.tolist() == [0.0]
    path = greedy_path([[3, 1]], 10)
    assert path.generation.tolist() == [[0, 2]] and len(path.picks) == 2


def test_greedy_beats_uniform_and_fedeas_sits_near_greedy() -> None:
    counts = SKEWED
    fedeas = fedeas_generation(counts, 12)
    total = int(fedeas.sum())
    path = greedy_path(counts, total)
    greedy_after = path.imbalance[total]
    assert greedy_after <= imbalance_score(counts, fedeas) + 1e-12
    assert imbalance_score(counts, fedeas) < imbalance_score(counts, matched_quota("uniform", counts, total))


# --- beta path and the selection rule ---------------------------------------------------------------------------


def test_select_beta_takes_the_smallest_beta_meeting_both_limits() -> None:
    path = [
        BetaPoint(1.0, 10, 0.0, 0.30, 0.05),
        BetaPoint(2.0, 20, 0.0, 0.49, 0.10),
        BetaPoint(3.0, 30, 0.0, 0.55, 0.20),
        BetaPoint(4.0, 40, 0.0, 0.70, 0.24),
        BetaPoint(5.0, 50, 0.0, 0.80, 0.30),
    ]
    assert select_beta(path).beta == 3.0
    assert select_beta(path[::-1]).beta == 3.0
    assert select_beta(path, max_synthetic=0.15) is None


def test_beta_path_is_fedeas_at_each_beta() -> None:
    path = beta_path(SKEWED, [12.0, 4.0])
    assert [p.beta for p in path] == [4.0, 12.0]
    generation = fedeas_generation(SKEWED, 12)
    assert path[1].total == generation.sum()
    assert path[1].imbalance_after == pytest.approx(imbalance_score(SKEWED, generation))
    assert path[1].synthetic_fraction == pytest.approx(synthetic_fraction(SKEWED, generation))
    assert path[1].imbalance_removed > path[0].imbalance_removed > 0


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ([[1, -1]], r"counts\[0\]\[1\] = -1 is negative"),
        ([[1, 1.5]], r"1\.5 is not an integer"),
        ([[1, True]], r"True is not an integer"),
        ([[1, "3"]], r"'3' is not an integer"),
        ([[1, float("nan")]], r"nan is not an integer"),
        ([[1, 2], [3]], "ragged"),
        ([[0, 0], [1, 2]], "client 0 has no samples"),
        ([], "K = 0"),
        ([[5], [6]], "need at least 2"),
        (np.ones(4), "shape"),
        (7, "list of K rows"),
    ],
)
def test_bad_counts_raise_data_error_naming_the_value(counts: object, message: str) -> None:
    with pytest.raises(DataError, match=message):
        validate_counts(counts)


def test_integral_floats_are_accepted_as_counts() -> None:
    assert validate_counts([[1.0, 2.0]]).tolist() == [[1, 2]]
    assert validate_counts(np.array([[1, 2]], dtype=np.uint8)).dtype == np.int64


@pytest.mark.parametrize("beta", [0, -1.0, float("nan"), float("inf")])
def test_bad_beta_raises_config_error(beta: float) -> None:
    with pytest.raises(ConfigError, match="beta"):
        generation_matrix("fedeas", SKEWED, beta=beta)
    with pytest.raises(ConfigError, match="beta"):
        fedeas_client_budget([3, 1], beta)


def test_bad_policy_and_budget_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="'greedy'"):
        generation_matrix("greedy", SKEWED, beta=12)
    with pytest.raises(ConfigError, match="'full'"):
        matched_quota("full", SKEWED, 10)
    with pytest.raises(ConfigError, match="-5"):
        generation_matrix("uniform", SKEWED, beta=12, budget=-5)
    with pytest.raises(ConfigError, match="only to the uniform"):
        generation_matrix("fedeas", SKEWED, beta=12, budget=10)
