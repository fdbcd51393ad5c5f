"""Client partitions: IID and Dirichlet label skew, a seeded hold-out split, and the K x C label-count matrix.

Every split is a pure function of (labels, K, alpha, seed), so a node on another machine that
holds the same public labels computes the same shard for itself without seeing anyone's data.
"""

from __future__ import annotations

import numpy as np

from fedsynth.config import DataConfig, RunConfig
from fedsynth.config_schema import PARTITIONS
from fedsynth.learning.data import load_labels
from fedsynth.errors import ConfigError, DataError

MAX_REDRAWS = 1_000  # each draw is cheap, but an infeasible setting must fail in seconds, not spin


def _check(num_clients: int, labels: np.ndarray, min_size: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"number of clients must be >= 1, got {num_clients}")
    if min_size < 0:
        raise ConfigError(f"min_size must be >= 0, got {min_size}")
    if num_clients > len(labels):
        raise DataError(f"{num_clients} clients exceed the {len(labels)} samples: some would have none")
    if num_clients * min_size > len(labels):
        raise DataError(f"{num_clients} clients x min_size {min_size} exceeds the {len(labels)} samples")


def iid_partition(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle and deal the indices into K near-equal shards."""
    _check(num_clients, labels, 0)
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, *, min_size: int = 10
) -> list[np.ndarray]:
    """Per class c, p ~ Dir(alpha * 1_K) splits c's samples among the K clients; redraw until every shard >= min_size."""
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    _check(num_clients, labels, min_size)
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(MAX_REDRAWS):
        draws = []
        sizes = np.zeros(num_clients, dtype=np.int64)
        for indices in by_class:
            members = rng.permutation(indices)
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = np.clip((np.cumsum(p)[:-1] * len(members)).astype(int), 0, len(members))
            sizes += np.diff(cuts, prepend=0, append=len(members))
            draws.append((members, cuts))
        if sizes.min() >= min_size:  # only a draw that is kept is cut into shards
            shards = zip(*(np.split(members, cuts) for members, cuts in draws))
            return [np.sort(np.concatenate(parts)) for parts in shards]
    raise DataError(
        f"no Dirichlet draw (alpha={alpha}) of {len(labels)} labels gave every one of {num_clients} clients >= {min_size} "
        f"samples in {MAX_REDRAWS} tries; lower min_size or the number of clients, or raise alpha"
    )


def holdout_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of the training indices into (pool for clients, held-out real images)."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"holdout_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return np.arange(len(labels)), np.arange(0)
    rng = np.random.default_rng([seed, 0x401D])  # a stream apart from the partition's
    held: list[np.ndarray] = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        held.append(members[: int(round(len(members) * fraction))])
    holdout = np.sort(np.concatenate(held))
    pool = np.setdiff1d(np.arange(len(labels)), holdout, assume_unique=True)
    return pool, holdout


def partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    scheme: str = "dirichlet",
    alpha: float = 0.1,
    seed: int = 0,
    min_size: int = 10,
    holdout_fraction: float = 0.0,
) -> list[np.ndarray]:
    """Indices into `labels` for each client, after setting the hold-out split aside."""
    pool, _ = holdout_split(labels, holdout_fraction, seed)
    if scheme == "iid":
        local = iid_partition(labels[pool], num_clients, seed)
    elif scheme == "dirichlet":
        local = dirichlet_partition(labels[pool], num_clients, alpha, seed, min_size=min_size)
    else:
        raise ConfigError(f"unknown partition scheme {scheme!r}; expected one of {', '.join(PARTITIONS)}")
    return [pool[idx] for idx in local]


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """K x C matrix of label counts."""
    return np.stack([np.bincount(labels[idx], minlength=num_classes) for idx in parts]).astype(np.int64)


def partition_for(d: DataConfig, seed: int, labels: np.ndarray) -> list[np.ndarray]:
    """The partition a run's [data] section names; one it cannot give is a ConfigError naming the data.* keys."""
    try:
        return partition(labels, d.clients, scheme=d.partition, alpha=d.alpha, seed=seed, min_size=d.min_size,
                         holdout_fraction=d.holdout_fraction)
    except DataError as exc:
        keys = [f"data.clients={d.clients}", f"data.min_size={d.min_size}"]
        keys += [f"data.alpha={d.alpha}"] if d.partition == "dirichlet" else []
        keys += [f"data.holdout_fraction={d.holdout_fraction}"] if d.holdout_fraction else []
        raise ConfigError(f"{', '.join(keys)} ({d.dataset} training labels): {exc}") from exc


def check_partition(cfg: RunConfig) -> None:
    """Refuse, in seconds and before any process starts, a run whose data cannot be split as configured (labels
    only); otherwise every client node would fail on its own, long after start."""
    d = cfg.data
    try:
        labels = load_labels(d.dataset, "train", data_dir=d.data_dir, download=d.download)
    except DataError as exc:
        raise ConfigError(f"data.dataset={d.dataset!r} (data.data_dir={d.data_dir!r}): {exc}") from exc
    partition_for(d, cfg.seed, labels)
