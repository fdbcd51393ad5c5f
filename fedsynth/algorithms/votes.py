"""Private Evolution's two sides as plain functions: a client's nearest-neighbour votes in a public embedding, and the
coordinator's noisy, thresholded histogram and the draw of the next population from it (Lin et al., ICLR 2024)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


EMBED_BATCH = 512


def embed(images: torch.Tensor, extractor: nn.Module | None) -> torch.Tensor:
    """N x C x H x W images in [-1, 1] -> N x D float32 features of the PUBLIC extractor: None is "pixels",
    hand-built (nothing trained, on any data: the image itself, flattened); a module is a classifier trained on public
    data, whose penultimate features (model.features) are L2-normalised, as DPSDA's embeddings are compared."""
    if extractor is None:
        return images.reshape(len(images), -1).to(torch.float32)
    with torch.inference_mode():
        parts = [extractor.features(images[start : start + EMBED_BATCH]) for start in range(0, len(images), EMBED_BATCH)]  # type: ignore[operator]
    features = torch.cat(parts).reshape(len(images), -1).to(torch.float32)
    return nn.functional.normalize(features, dim=1)


def nearest_votes(private: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor, per_class: int) -> torch.Tensor:
    """Each private feature row votes for its nearest candidate (L2) of its own class: float64 counts, one per
    candidate. Candidates are class-major: rows c*M .. c*M + M - 1 are class c's. Ties go to the lowest index."""
    num_classes = len(candidates) // per_class
    votes = torch.zeros(len(candidates), dtype=torch.float64)
    for c in range(num_classes):
        mine = private[labels == c]
        if len(mine) == 0:
            continue
        pool = candidates[c * per_class : (c + 1) * per_class]
        nearest = torch.cdist(mine.to(torch.float64), pool.to(torch.float64)).argmin(dim=1)
        votes[c * per_class : (c + 1) * per_class] += torch.bincount(nearest, minlength=per_class).to(torch.float64)
    return votes


def user_normalised(votes: torch.Tensor) -> torch.Tensor:
    """A client's whole vote vector scaled to L2 norm 1 (DPSDA's client-level normalisation): adding or removing the
    client moves the sum by at most 1 in L2, whatever its size. A client without a vote sends zeros."""
    norm = float(votes.norm())
    return votes / norm if norm > 0 else votes


def bounded_votes(votes: torch.Tensor, *, dp: str, num_samples: int) -> tuple[torch.Tensor, bool]:
    """(a peer's vote vector as it may count, whether it had to be cut): user, an L2 norm of at most 1; sample and
    none, at most num_samples votes in all (one per image the client registered). The caller has checked that every
    entry is finite and >= 0."""
    votes = votes.to(torch.float64)
    if dp == "user":
        norm = float(votes.norm())
        return (votes / norm, True) if norm > 1.0 + 1e-9 else (votes, False)
    total = float(votes.sum())
    return (votes * (num_samples / total), True) if total > num_samples else (votes, False)


def noisy_histogram(total: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """The summed votes plus N(0, sigma^2) on every entry: the Gaussian mechanism at L2 sensitivity 1."""
    if sigma == 0:
        return total.clone()
    return total + sigma * torch.randn(total.shape, generator=generator, dtype=torch.float64)


def draw_population(histogram: torch.Tensor, per_class: int, threshold: float, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """Indices of the next population, class-major (per_class a class), drawn with replacement in proportion to
    max(noisy votes - threshold, 0) within each class; a class none of whose candidates passes keeps its candidates
    as they are. Returns (indices, the classes that kept theirs)."""
    num_classes = len(histogram) // per_class
    chosen, kept = [], []
    for c in range(num_classes):
        weights = np.clip(histogram[c * per_class : (c + 1) * per_class].numpy() - threshold, 0.0, None)
        if weights.sum() <= 0:
            kept.append(c)
            chosen.append(c * per_class + np.arange(per_class))
            continue
        chosen.append(c * per_class + rng.choice(per_class, size=per_class, replace=True, p=weights / weights.sum()))
    return np.concatenate(chosen), kept


def strength_at(iteration: int, iterations: int, start: float, end: float) -> float:
    """The variation strength after iteration t of T (1-based): start after the first, end after the last, linear."""
    if iterations <= 1:
        return end
    return start + (end - start) * (iteration - 1) / (iterations - 1)
