"""Normalized Shannon entropy of a client's label distribution, H~_k = H_k / ln C with 0 ln 0 = 0."""

from __future__ import annotations

import math

import numpy as np

from fedsynth.allocation.validation import validate_counts, validate_counts_row


def _normalized_entropy(row: np.ndarray) -> float:
    """H~ of a validated counts row, in [0, 1]; exactly 1.0 for a balanced row and 0.0 for a single-class one."""
    present = row[row > 0]
    if len(present) == len(row) and np.all(present == present[0]):
        return 1.0  # balanced: ln C computed two ways differs in the last bit, and 1 - H~ must be exactly 0
    p = present / present.sum()
    entropy = float(-(p * np.log(p)).sum())
    return min(1.0, max(0.0, entropy / math.log(len(row))))


def normalized_entropy(counts_row: object) -> float:
    """H~_k of one client's label counts."""
    return _normalized_entropy(validate_counts_row(counts_row))


def normalized_entropies(counts: object) -> np.ndarray:
    """H~_k for every client of a K x C count table."""
    matrix = validate_counts(counts)
    return np.array([_normalized_entropy(row) for row in matrix])
