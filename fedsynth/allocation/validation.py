"""Checks for label-count tables, generation tables, beta, budgets and policy names; errors name the bad value."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

from fedsynth.config_schema import POLICIES
from fedsynth.errors import ConfigError, DataError

MATCHED_POLICIES = ("uniform", "missing")
MAX_COUNT = 2**53  # beyond this neither int64 sums nor float shares stay exact


def _integer_count(value: Any, where: str) -> int:
    """One count as a Python int: integers, or floats with an integral value (3.0); never bools, NaN or 1.5."""
    if isinstance(value, (bool, np.bool_)):
        raise DataError(f"{where} = {value!r} is not an integer count")
    if isinstance(value, (int, np.integer)):
        count = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        count = int(value)
    else:
        raise DataError(f"{where} = {value!r} is not an integer count")
    if count < 0:
        raise DataError(f"{where} = {count} is negative")
    if count > MAX_COUNT:
        raise DataError(f"{where} = {count} is larger than {MAX_COUNT}")
    return count


def _rows(table: Any, name: str) -> list[list[Any]]:
    """The table as a list of rows (lists), rejecting scalars, 1-D input and ragged rows."""
    if isinstance(table, np.ndarray):
        if table.ndim != 2:
            raise DataError(f"{name} must be a K x C table, got an array of shape {table.shape}")
        return table.tolist()
    if not isinstance(table, (list, tuple)):
        raise DataError(f"{name} must be a list of K rows of C counts, got {type(table).__name__}")
    rows: list[list[Any]] = []
    for k, row in enumerate(table):
        if isinstance(row, np.ndarray) and row.ndim == 1:
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise DataError(f"{name}[{k}] must be a row of counts, got {row!r}")
        rows.append(list(row))
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        first = len(rows[0])
        bad = next(k for k, row in enumerate(rows) if len(row) != first)
        raise DataError(f"{name} rows are ragged: row 0 has {first} classes but row {bad} has {len(rows[bad])}")
    return rows


def validate_counts(counts: Any) -> np.ndarray:
    """K x C int64 copy of a label-count table with K >= 1 clients, C >= 2 classes and no empty client."""
    rows = _rows(counts, "counts")
    if len(rows) < 1:
        raise DataError("counts has no clients (K = 0); need K >= 1")
    num_classes = len(rows[0])
    if num_classes < 2:
        raise DataError(f"counts have {num_classes} class(es) per client; need at least 2")
    matrix = np.array(
        [[_integer_count(v, f"counts[{k}][{c}]") for c, v in enumerate(row)] for k, row in enumerate(rows)],
        dtype=np.int64,
    )
    empty = np.flatnonzero(matrix.sum(axis=1) == 0)
    if len(empty):
        raise DataError(f"client {int(empty[0])} has no samples (its counts row sums to 0)")
    return matrix


def validate_counts_row(counts_row: Any) -> np.ndarray:
    """One client's label counts as a 1-D int64 array (C >= 2, not all zero)."""
    if isinstance(counts_row, np.ndarray) and counts_row.ndim != 1:
        raise DataError(f"counts_row must be 1-D, got an array of shape {counts_row.shape}")
    return validate_counts([counts_row] if not isinstance(counts_row, np.ndarray) else [counts_row.tolist()])[0]


def validate_generation(generation: Any, shape: tuple[int, int], *, integer: bool = True) -> np.ndarray:
    """A K x C table of added samples matching `shape`: integers (int64) or, with integer=False, finite reals >= 0."""
    rows = _rows(generation, "generation")
    got = (len(rows), len(rows[0]) if rows else 0)
    if got != shape:
        raise DataError(f"generation has shape {got}, expected {shape} to match counts")
    if integer:
        return np.array(
            [[_integer_count(v, f"generation[{k}][{c}]") for c, v in enumerate(r)] for k, r in enumerate(rows)],
            dtype=np.int64,
        )
    values = np.asarray(rows, dtype=np.float64)
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        k, c = np.argwhere(~(np.isfinite(values) & (values >= 0)))[0]
        raise DataError(f"generation[{k}][{c}] = {values[k, c]!r} must be a finite value >= 0")
    return values


def validate_beta(beta: Any) -> float:
    if isinstance(beta, bool) or not isinstance(beta, Real) or not math.isfinite(beta) or not float(beta) > 0:
        raise ConfigError(f"beta must be a finite number > 0, got {beta!r}")
    return float(beta)


def validate_exponent(exponent: Any) -> float:
    if (
        isinstance(exponent, bool)
        or not isinstance(exponent, Real)
        or not math.isfinite(exponent)
        or float(exponent) < 0
    ):
        raise ConfigError(f"exponent must be a finite number >= 0, got {exponent!r}")
    return float(exponent)


def validate_budget(budget: Any) -> int:
    """A total image budget: an integer >= 0."""
    integral = isinstance(budget, (int, np.integer)) or (isinstance(budget, float) and budget.is_integer())
    if isinstance(budget, bool) or not integral or budget < 0:
        raise ConfigError(f"budget must be an integer >= 0, got {budget!r}")
    return int(budget)


def validate_policy(policy: Any, allowed: tuple[str, ...] = POLICIES) -> str:
    if policy not in allowed:
        raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(allowed)}")
    return str(policy)
