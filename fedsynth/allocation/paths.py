"""Imbalance against budget: the greedy reference path, the FedEAS beta path, matched baselines and the beta rule."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fedsynth.allocation.baselines import _matched
from fedsynth.allocation.fedeas import PAPER_EXPONENT, _generation
from fedsynth.allocation.imbalance import _check_weights, imbalance_score
from fedsynth.allocation.validation import (
    MATCHED_POLICIES,
    validate_beta,
    validate_budget,
    validate_counts,
    validate_exponent,
    validate_policy,
)
from fedsynth.errors import ConfigError

DEFAULT_BETAS: tuple[float, ...] = tuple(0.5 * i for i in range(1, 97))  # 0.5, 1.0, ..., 48.0
MIN_REMOVED = 0.5  # the selection rule: remove at least half of I ...
MAX_SYNTHETIC = 0.25  # ... while synthetic samples stay at most a quarter of the training data
BALANCED_GAIN = 1e-12  # a largest gain at or below this means every client is balanced: the greedy path stops


@dataclass(frozen=True)
class GreedyPath:
    """One sample at a time at the pair of largest Delta (recomputed after each step)."""

    picks: np.ndarray  # S x 2 int64: (client, class) of each step, in order
    imbalance: np.ndarray  # S + 1 floats: I before any step, then after each step
    generation: np.ndarray  # K x C int64 after all S steps


def greedy_path(counts: object, steps: int, *, weights: str = "augmented") -> GreedyPath:
    """The greedy reference path of up to `steps` samples (fewer only if every client becomes balanced).

    Delta_k^c = 2 p_k / N_k (||q_k||^2 - q_k^c) with p_k = N_k / N of the current counts, so 2 p_k / N_k = 2 / N is
    the same for every client and the argmax is that of ||q_k||^2 - q_k^c: per client, its rarest class. A step
    changes one client's row, so only that client's best gain is recomputed. `weights` only affects the recorded I.
    """
    _check_weights(weights)
    original = validate_counts(counts)
    steps = validate_budget(steps)
    current = original.copy()
    num_classes = current.shape[1]
    sizes = current.sum(axis=1).astype(np.float64)
    squares = (current.astype(np.float64) ** 2).sum(axis=1)  # sum_c n_c^2, so ||q_k||^2 = squares / N_k^2
    row_gain = squares / sizes**2 - current.min(axis=1) / sizes
    fixed_p = original.sum(axis=1) / original.sum()

    def score() -> float:
        norms = squares / sizes**2 - 1.0 / num_classes  # ||q_k - u||^2
        p = sizes / sizes.sum() if weights == "augmented" else fixed_p
        return float(p @ norms)

    picks: list[tuple[int, int]] = []
    imbalance = [score()]
    for _ in range(steps):
        k = int(np.argmax(row_gain))
        if row_gain[k] <= BALANCED_GAIN:
            break
        c = int(np.argmin(current[k]))
        squares[k] += 2 * current[k, c] + 1
        current[k, c] += 1
        sizes[k] += 1
        row_gain[k] = squares[k] / sizes[k] ** 2 - current[k].min() / sizes[k]
        picks.append((k, c))
        imbalance.append(score())
    return GreedyPath(
        picks=np.array(picks, dtype=np.int64).reshape(-1, 2),
        imbalance=np.array(imbalance),
        generation=current - original,
    )


@dataclass(frozen=True)
class BetaPoint:
    """FedEAS at one beta: total images, I after generation, the share of I removed, the synthetic fraction."""

    beta: float
    total: int
    imbalance_after: float
    imbalance_removed: float
    synthetic_fraction: float


def beta_path(
    counts: object,
    betas: Iterable[float] = DEFAULT_BETAS,
    *,
    weights: str = "augmented",
    exponent: float = PAPER_EXPONENT,
    entropy_factor: bool = True,
) -> list[BetaPoint]:
    """FedEAS over increasing beta."""
    _check_weights(weights)
    matrix = validate_counts(counts)
    exponent = validate_exponent(exponent)
    before = imbalance_score(matrix, weights=weights)
    real = int(matrix.sum())
    points = []
    for beta in sorted(validate_beta(b) for b in betas):
        generation = _generation(matrix, beta, exponent, entropy_factor)
        after = imbalance_score(matrix, generation, weights=weights)
        total = int(generation.sum())
        removed = 1.0 - after / before if before > 0 else 0.0
        points.append(BetaPoint(beta, total, after, removed, total / (real + total)))
    return points


def select_beta(
    path: Sequence[BetaPoint], *, min_removed: float = MIN_REMOVED, max_synthetic: float = MAX_SYNTHETIC
) -> BetaPoint | None:
    """The smallest beta on the path that removes >= min_removed of I with synthetic fraction <= max_synthetic."""
    if not 0.0 <= min_removed <= 1.0 or not 0.0 <= max_synthetic <= 1.0:
        raise ConfigError(f"min_removed and max_synthetic must lie in [0, 1], got {min_removed!r}, {max_synthetic!r}")
    for point in sorted(path, key=lambda p: p.beta):
        if point.imbalance_removed >= min_removed and point.synthetic_fraction <= max_synthetic:
            return point
    return None


def matched_path(policy: str, counts: object, totals: Iterable[int], *, weights: str = "augmented") -> np.ndarray:
    """I after Uniform or Missing-only spends each budget in `totals` (one float per total)."""
    policy = validate_policy(policy, MATCHED_POLICIES)
    matrix = validate_counts(counts)
    return np.array(
        [imbalance_score(matrix, _matched(policy, matrix, validate_budget(t)), weights=weights) for t in totals]
    )
