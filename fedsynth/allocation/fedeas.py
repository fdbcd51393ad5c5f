"""FedEAS: the per-client budget b_k = floor((N_k / C)^gamma * (1 - H~_k) * beta) and its top-up generation."""

from __future__ import annotations

import math

import numpy as np

from fedsynth.allocation.entropy import _normalized_entropy
from fedsynth.allocation.validation import validate_beta, validate_counts, validate_counts_row, validate_exponent

PAPER_EXPONENT = 0.5  # sqrt(n_bar); exponent=1.0 is the "linear" ablation
# The product is evaluated in floating point; when it is mathematically an integer (e.g. sqrt(4) * 12 = 24) it can
# land a hair below. This absolute slack keeps floor() exact there and is far below any real fractional part.
FLOOR_SLACK = 1e-9


def _budget(row: np.ndarray, beta: float, exponent: float, entropy_factor: bool) -> int:
    mean_per_class = row.sum() / len(row)
    skew = 1.0 - _normalized_entropy(row) if entropy_factor else 1.0
    return math.floor(mean_per_class**exponent * skew * beta + FLOOR_SLACK)


def _generation_row(row: np.ndarray, beta: float, exponent: float, entropy_factor: bool) -> np.ndarray:
    budget = _budget(row, beta, exponent, entropy_factor)
    return np.maximum(0, budget - row).astype(np.int64)


def fedeas_client_budget(
    counts_row: object, beta: float, *, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> int:
    """b_k from one client's own label counts. exponent=1 and entropy_factor=False give the paper's ablations."""
    return _budget(validate_counts_row(counts_row), validate_beta(beta), validate_exponent(exponent), entropy_factor)


def fedeas_generation_row(
    counts_row: object, beta: float, *, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> np.ndarray:
    """Images per class that one client generates: max(0, b_k - n_k^c), int64, from its own counts only."""
    row = validate_counts_row(counts_row)
    return _generation_row(row, validate_beta(beta), validate_exponent(exponent), entropy_factor)


def fedeas_budgets(
    counts: object, beta: float, *, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> np.ndarray:
    """b_k for every client (int64, length K)."""
    matrix, beta, exponent = validate_counts(counts), validate_beta(beta), validate_exponent(exponent)
    return np.array([_budget(row, beta, exponent, entropy_factor) for row in matrix], dtype=np.int64)


def fedeas_generation(
    counts: object, beta: float, *, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> np.ndarray:
    """K x C int64: each row is exactly what that client computes alone with fedeas_generation_row."""
    matrix, beta, exponent = validate_counts(counts), validate_beta(beta), validate_exponent(exponent)
    return _generation(matrix, beta, exponent, entropy_factor)


def _generation(
    matrix: np.ndarray, beta: float, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> np.ndarray:
    return np.stack([_generation_row(row, beta, exponent, entropy_factor) for row in matrix])
