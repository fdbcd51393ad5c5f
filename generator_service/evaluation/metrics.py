"""The figures of `fedsynth generator evaluate`: recognizability and the Fréchet distance between feature Gaussians.

The Fréchet distance is FID's formula, ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), applied to the judge's
penultimate features instead of Inception's (whose weights are not on disk here). Figures are comparable only
between evaluations with the same judge and the same number of images per class (the estimate is biased upwards
at small N).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import linalg

SQRTM_EPS = 1e-6  # added to both diagonals when (S1 S2)^(1/2) is singular, as pytorch-fid does


@dataclass(frozen=True)
class FeatureStats:
    """Mean and covariance of features, over all images and per class."""

    mean: np.ndarray  # D
    cov: np.ndarray  # D x D
    class_mean: np.ndarray  # C x D
    class_cov: np.ndarray  # C x D x D

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}_{name}": getattr(self, name) for name in ("mean", "cov", "class_mean", "class_cov")}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], prefix: str) -> FeatureStats:
        return cls(*(np.asarray(arrays[f"{prefix}_{name}"]) for name in ("mean", "cov", "class_mean", "class_cov")))


def _mean_cov(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(features) < 2:
        raise ValueError(f"a covariance needs at least 2 feature vectors, got {len(features)}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def feature_stats(features: np.ndarray, labels: np.ndarray, num_classes: int) -> FeatureStats:
    mean, cov = _mean_cov(features)
    per_class = [_mean_cov(features[labels == c]) for c in range(num_classes)]
    return FeatureStats(mean, cov, np.stack([m for m, _ in per_class]), np.stack([s for _, s in per_class]))


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    diff = mu1 - mu2
    with warnings.catch_warnings():  # rank-deficient covariances (N <= D) are expected; non-finite results are handled
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        covmean = linalg.sqrtm(cov1 @ cov2)
        if not np.isfinite(covmean).all():
            offset = np.eye(len(cov1)) * SQRTM_EPS
            covmean = linalg.sqrtm((cov1 + offset) @ (cov2 + offset))
    covmean = np.real(covmean)  # numerical noise gives tiny imaginary parts
    return float(max(0.0, diff @ diff + np.trace(cov1) + np.trace(cov2) - 2.0 * np.trace(covmean)))


def frechet_to(reference: FeatureStats, other: FeatureStats) -> tuple[float, list[float]]:
    """(overall, per class) Fréchet distance of `other` to `reference`."""
    overall = frechet_distance(other.mean, other.cov, reference.mean, reference.cov)
    per_class = [frechet_distance(other.class_mean[c], other.class_cov[c], reference.class_mean[c], reference.class_cov[c])
                 for c in range(len(reference.class_mean))]
    return overall, per_class


def recognizability(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[float, list[float]]:
    """(share of all images the judge assigns to their class, the same per class)."""
    hits = predicted == labels
    return float(hits.mean()), [float(hits[labels == c].mean()) for c in range(num_classes)]


def confusion(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> list[list[int]]:
    """counts[c][p]: images of class c the judge called p."""
    table = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(table, (labels, predicted), 1)
    return table.tolist()
