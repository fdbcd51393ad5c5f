"""Baseline policies: matched-budget Uniform and Missing-only, Full-Balance (fill up to the largest class), none."""

from __future__ import annotations

import numpy as np

from fedsynth.allocation.validation import MATCHED_POLICIES, validate_budget, validate_counts, validate_policy
from fedsynth.errors import DataError


def spread_evenly(total: int, eligible: np.ndarray) -> np.ndarray:
    """floor(total / M) to each of the M eligible pairs, then +1 to the first (total mod M) in row-major order."""
    pairs = np.flatnonzero(eligible.ravel())  # ravel is row-major: client 0's classes first, then client 1's, ...
    quota = np.zeros(eligible.size, dtype=np.int64)
    if total == 0:
        return quota.reshape(eligible.shape)
    if len(pairs) == 0:
        raise DataError(f"no eligible (client, class) pair to spend a budget of {total} images on")
    base, remainder = divmod(total, len(pairs))
    quota[pairs] = base
    quota[pairs[:remainder]] += 1
    return quota.reshape(eligible.shape)


def _matched(policy: str, matrix: np.ndarray, total: int) -> np.ndarray:
    eligible = np.ones(matrix.shape, dtype=bool) if policy == "uniform" else matrix == 0
    if policy == "missing" and total > 0 and not eligible.any():
        raise DataError(f"missing-only: every client holds every class, so there is no absent pair for {total} images")
    return spread_evenly(total, eligible)


def uniform_quota(counts: object, total: int) -> np.ndarray:
    """Uniform: the budget spread over every (client, class) pair."""
    return _matched("uniform", validate_counts(counts), validate_budget(total))


def missing_only_quota(counts: object, total: int) -> np.ndarray:
    """Missing-only: the budget spread over the absent pairs (n_k^c = 0) only."""
    return _matched("missing", validate_counts(counts), validate_budget(total))


def matched_quota(policy: str, counts: object, total: int) -> np.ndarray:
    """K x C int64 for "uniform" or "missing", spending exactly `total` images."""
    return _matched(validate_policy(policy, MATCHED_POLICIES), validate_counts(counts), validate_budget(total))


def _full_balance(matrix: np.ndarray) -> np.ndarray:
    return (matrix.max(axis=1, keepdims=True) - matrix).astype(np.int64)


def full_balance(counts: object) -> np.ndarray:
    """Full-Balance (Gen-FedSD's policy): every class topped up to the client's largest class."""
    return _full_balance(validate_counts(counts))
