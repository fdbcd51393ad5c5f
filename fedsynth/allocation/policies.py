"""One entry point for every policy: the K x C generation matrix the runtime hands to its clients."""

from __future__ import annotations

import numpy as np

from fedsynth.allocation.baselines import _full_balance, _matched
from fedsynth.allocation.fedeas import _generation
from fedsynth.allocation.validation import (
    MATCHED_POLICIES,
    validate_beta,
    validate_budget,
    validate_counts,
    validate_policy,
)
from fedsynth.errors import ConfigError


def generation_matrix(policy: str, counts: object, *, beta: float, budget: int | None = None) -> np.ndarray:
    """Images per (client, class), int64 K x C.

    uniform / missing spend `budget` if given, else the FedEAS total at `beta` (the matched-budget protocol);
    `budget` is refused for the other policies rather than ignored.
    """
    policy = validate_policy(policy)
    matrix = validate_counts(counts)
    beta = validate_beta(beta)
    if budget is not None and policy not in MATCHED_POLICIES:
        raise ConfigError(f"budget={budget!r} applies only to the uniform and missing policies, not {policy!r}")
    if policy == "none":
        return np.zeros(matrix.shape, dtype=np.int64)
    if policy == "full":
        return _full_balance(matrix)
    fedeas = _generation(matrix, beta)
    if policy == "fedeas":
        return fedeas
    total = int(fedeas.sum()) if budget is None else validate_budget(budget)
    return _matched(policy, matrix, total)
