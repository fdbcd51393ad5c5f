"""DESIGN.md's allocation formulas written out again in plain Python, so tests check the product against them."""

from __future__ import annotations

import math

# A float product that is mathematically an integer (sqrt(16) * 0.5 * 12 = 24) may land a hair below it.
FLOOR_SLACK = 1e-9


def fedeas_budget(row: list[int], beta: float, *, exponent: float = 0.5, entropy_factor: bool = True) -> int:
    """b_k = floor(sqrt(N_k / C) * (1 - H_k / ln C) * beta), H_k the Shannon entropy with 0 ln 0 = 0.

    The paper's ablations (Table 2): (N_k / C) ** exponent instead of the sqrt, and no (1 - H_k / ln C) factor."""
    size, classes = sum(row), len(row)
    entropy = -sum(n / size * math.log(n / size) for n in row if n > 0)
    skew = 1 - entropy / math.log(classes) if entropy_factor else 1.0
    return math.floor((size / classes) ** exponent * skew * beta + FLOOR_SLACK)


def fedeas(counts: list[list[int]], beta: float, *, exponent: float = 0.5, entropy_factor: bool = True) -> list[list[int]]:
    """max(0, b_k - n_k^c) for every client and class."""
    rule = {"exponent": exponent, "entropy_factor": entropy_factor}
    return [[max(0, fedeas_budget(row, beta, **rule) - n) for n in row] for row in counts]


def matched(counts: list[list[int]], total: int, *, missing_only: bool) -> list[list[int]]:
    """floor(B / M) to each of the M eligible pairs, the remainder +1 to pairs in row-major order."""
    pairs = [(k, c) for k, row in enumerate(counts) for c, n in enumerate(row) if n == 0 or not missing_only]
    base, remainder = divmod(total, len(pairs))
    out = [[0] * len(row) for row in counts]
    for i, (k, c) in enumerate(pairs):
        out[k][c] = base + (1 if i < remainder else 0)
    return out


def full_balance(counts: list[list[int]]) -> list[list[int]]:
    return [[max(row) - n for n in row] for row in counts]


def imbalance(counts: list[list[int]], added: list[list[int]] | None = None) -> float:
    """I = sum_k p_k ||q_k - u||^2 of counts + added, p_k from the augmented sizes."""
    rows = [[n + (added[k][c] if added else 0) for c, n in enumerate(row)] for k, row in enumerate(counts)]
    total = sum(map(sum, rows))
    return sum(sum(row) / total * sum((n / sum(row) - 1 / len(row)) ** 2 for n in row) for row in rows)


def selected_beta(counts: list[list[int]], *, min_removed: float = 0.5, max_synthetic: float = 0.25) -> float | None:
    """The smallest beta in 0.5, 1.0, ..., 48 whose FedEAS plan removes >= min_removed of I with a synthetic
    fraction <= max_synthetic."""
    before, real = imbalance(counts), sum(map(sum, counts))
    for beta in (0.5 * i for i in range(1, 97)):
        added = fedeas(counts, beta)
        total = sum(map(sum, added))
        if 1 - imbalance(counts, added) / before >= min_removed and total / (real + total) <= max_synthetic:
            return beta
    return None
