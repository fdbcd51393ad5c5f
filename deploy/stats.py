"""Statistics over seeds: mean, sample std, Student-t confidence intervals and paired differences."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats as scipy_stats

from fedsynth.errors import ConfigError


@dataclass(frozen=True)
class Summary:
    """n values summarised; std is the sample std (ddof=1); the interval is None when n < 2."""

    n: int
    mean: float | None
    std: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PairedDifference:
    """a - b for every seed both have, and the summary of those differences."""

    seeds: list[int]
    differences: list[float]
    summary: Summary

    def to_dict(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "differences": self.differences, **self.summary.to_dict()}


def t_critical(n: int, confidence: float = 0.95) -> float:
    """Two-sided Student-t quantile with n - 1 degrees of freedom (4.3027 for n = 3 at 95%)."""
    if n < 2:
        raise ConfigError(f"a t-interval needs at least 2 values, got {n}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    return float(scipy_stats.t.ppf(0.5 + confidence / 2, df=n - 1))


def summarize(values: Sequence[float], confidence: float = 0.95) -> Summary:
    """Mean, sample std and the t-interval mean ± t·std/sqrt(n); None where there are too few values."""
    clean = [float(v) for v in values]
    if any(not math.isfinite(v) for v in clean):
        raise ConfigError(f"cannot summarise non-finite values {clean}")
    n = len(clean)
    if n == 0:
        return Summary(0, None, None, None, None, confidence)
    mean = sum(clean) / n
    if n == 1:
        return Summary(1, mean, None, None, None, confidence)
    std = math.sqrt(sum((v - mean) ** 2 for v in clean) / (n - 1))
    half = t_critical(n, confidence) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half, confidence)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], confidence: float = 0.95) -> PairedDifference:
    """Per-seed differences a[s] - b[s] over the seeds present in both, with their mean and t-interval."""
    seeds = sorted(set(a) & set(b))
    differences = [float(a[s]) - float(b[s]) for s in seeds]
    return PairedDifference(seeds, differences, summarize(differences, confidence))


__all__ = ["PairedDifference", "Summary", "paired_difference", "summarize", "t_critical"]
