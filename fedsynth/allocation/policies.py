"""The one policy dispatch: what each client generates, what the coordinator assigns, and the K x C plan of both."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fedsynth.allocation.baselines import _full_balance, _matched
from fedsynth.allocation.fedeas import PAPER_EXPONENT, _generation_row
from fedsynth.allocation.validation import (
    MATCHED_POLICIES,
    validate_beta,
    validate_budget,
    validate_counts,
    validate_counts_row,
    validate_exponent,
    validate_policy,
)
from fedsynth.errors import ConfigError, DataError


def client_quota(
    policy: str,
    counts_row: object,
    *,
    beta: float,
    assigned: Sequence[int] | np.ndarray | None = None,
    exponent: float = PAPER_EXPONENT,
    entropy_factor: bool = True,
) -> np.ndarray:
    """Images per class one client generates (int64, length C).

    none, fedeas and full need only the client's own counts; uniform and missing take the row the coordinator
    `assigned` (from assigned_quota), which must have one entry per class.
    """
    policy = validate_policy(policy)
    row = validate_counts_row(counts_row)
    if policy == "none":
        return np.zeros(len(row), dtype=np.int64)
    if policy == "fedeas":
        return _generation_row(row, validate_beta(beta), validate_exponent(exponent), entropy_factor)
    if policy == "full":
        return _full_balance(row[None, :])[0]
    if assigned is None or len(assigned) != len(row):
        got = "none" if assigned is None else f"{len(assigned)} classes"
        raise DataError(f"policy {policy!r} needs an assigned row of {len(row)} classes, got {got}")
    return np.asarray(assigned, dtype=np.int64)


def assigned_quota(
    policy: str,
    shape: tuple[int, int],
    *,
    missing: Mapping[int, Iterable[int]],
    fedeas_totals: Iterable[int],
    budget: int | None = None,
) -> np.ndarray | None:
    """The K x C rows the coordinator assigns under uniform / missing; None under the other policies.

    B is `budget`, else the sum of the FedEAS totals the clients reported (the matched-budget protocol). Only
    absence matters to these rules, so a client is known by the classes it reported `missing` (none: all present).
    """
    if validate_policy(policy) not in MATCHED_POLICIES:
        return None
    present = np.ones(shape, dtype=np.int64)  # 1 stands for "present": the rules never read the counts themselves
    for client, classes in missing.items():
        present[client, list(classes)] = 0
    total = sum(fedeas_totals) if budget is None else budget
    return _matched(policy, present, validate_budget(total))


def generation_matrix(
    policy: str,
    counts: object,
    *,
    beta: float,
    budget: int | None = None,
    exponent: float = PAPER_EXPONENT,
    entropy_factor: bool = True,
) -> np.ndarray:
    """Images per (client, class), int64 K x C: row k is what client k generates in a run with these counts.

    uniform / missing spend `budget` if given, else the FedEAS total at `beta` (the matched-budget protocol);
    `budget` is refused for the other policies rather than ignored.
    """
    policy = validate_policy(policy)
    matrix = validate_counts(counts)
    beta = validate_beta(beta)
    if budget is not None and policy not in MATCHED_POLICIES:
        raise ConfigError(f"budget={budget!r} applies only to the uniform and missing policies, not {policy!r}")

    def own(name: str, row: np.ndarray, assigned: np.ndarray | None = None) -> np.ndarray:
        return client_quota(name, row, beta=beta, assigned=assigned, exponent=exponent, entropy_factor=entropy_factor)

    assigned = assigned_quota(
        policy,
        (matrix.shape[0], matrix.shape[1]),
        missing={k: np.flatnonzero(row == 0).tolist() for k, row in enumerate(matrix)},
        fedeas_totals=(int(own("fedeas", row).sum()) for row in matrix),
        budget=budget,
    )
    return np.stack([own(policy, row, None if assigned is None else assigned[k]) for k, row in enumerate(matrix)])
