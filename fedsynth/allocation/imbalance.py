"""The imbalance score I = sum_k p_k ||q_k - u||^2, its first-order gain Delta_k^c and its within/between split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsynth.allocation.validation import validate_counts, validate_generation
from fedsynth.errors import ConfigError

# How p_k is taken once synthetic samples are added: "augmented" uses the augmented sizes (N_k + G_k) / (N + G),
# i.e. the score of the training data the clients actually hold; "original" keeps p_k = N_k / N, the FedAvg weights.
WEIGHTINGS = ("augmented", "original")


def _check_weights(weights: str) -> None:
    if weights not in WEIGHTINGS:
        raise ConfigError(f"unknown weights {weights!r}; expected one of {', '.join(WEIGHTINGS)}")


def _augmented(counts: object, generation: object | None) -> tuple[np.ndarray, np.ndarray]:
    """(original counts, counts + generation) as float arrays; generation may hold fractional mass."""
    matrix = validate_counts(counts)
    if generation is None:
        return matrix.astype(np.float64), matrix.astype(np.float64)
    added = validate_generation(generation, matrix.shape, integer=False)
    return matrix.astype(np.float64), matrix + added


def client_imbalance(counts: object, generation: object | None = None, *, weights: str = "augmented") -> np.ndarray:
    """Each client's term p_k ||q_k - u||^2 of I (length K); they sum to imbalance_score."""
    _check_weights(weights)
    original, augmented = _augmented(counts, generation)
    sizes = augmented.sum(axis=1)
    q = augmented / sizes[:, None]
    basis = sizes if weights == "augmented" else original.sum(axis=1)
    p = basis / basis.sum()
    u = 1.0 / q.shape[1]
    return p * ((q - u) ** 2).sum(axis=1)


def imbalance_score(counts: object, generation: object | None = None, *, weights: str = "augmented") -> float:
    """I of the counts, or of counts + generation (p_k per `weights`)."""
    return float(client_imbalance(counts, generation, weights=weights).sum())


def imbalance_removed(counts: object, generation: object, *, weights: str = "augmented") -> float:
    """1 - I(counts + generation) / I(counts); 0.0 when the counts are already balanced (I = 0)."""
    before = imbalance_score(counts, weights=weights)
    if before == 0.0:
        return 0.0
    return 1.0 - imbalance_score(counts, generation, weights=weights) / before


def first_order_gain(counts: object) -> np.ndarray:
    """Delta_k^c = 2 p_k / N_k (||q_k||^2 - q_k^c): the drop in I per unit of mass added at (k, c), p held fixed."""
    matrix = validate_counts(counts).astype(np.float64)
    sizes = matrix.sum(axis=1)
    q = matrix / sizes[:, None]
    p = sizes / sizes.sum()
    return (2.0 * p / sizes)[:, None] * ((q**2).sum(axis=1)[:, None] - q)


def synthetic_fraction(counts: object, generation: object) -> float:
    """Generated / (real + generated), over all clients."""
    matrix = validate_counts(counts)
    added = validate_generation(generation, matrix.shape)
    total = int(added.sum())
    return total / (int(matrix.sum()) + total)


@dataclass(frozen=True)
class ImbalanceDecomposition:
    """sum_k p_k ||q_k - u||^2 = within + between, with qbar = sum_k p_k q_k the global label distribution."""

    total: float
    within: float  # sum_k p_k ||q_k - qbar||^2: how far clients are from each other (what local generation can fix)
    between: float  # ||qbar - u||^2: skew of the pooled data itself


def imbalance_decomposition(counts: object) -> ImbalanceDecomposition:
    matrix = validate_counts(counts).astype(np.float64)
    sizes = matrix.sum(axis=1)
    q = matrix / sizes[:, None]
    p = sizes / sizes.sum()
    qbar = p @ q
    u = 1.0 / q.shape[1]
    return ImbalanceDecomposition(
        total=float((p * ((q - u) ** 2).sum(axis=1)).sum()),
        within=float((p * ((q - qbar) ** 2).sum(axis=1)).sum()),
        between=float(((qbar - u) ** 2).sum()),
    )
