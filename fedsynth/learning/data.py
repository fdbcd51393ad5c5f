"""Datasets as in-memory uint8 arrays: embedded `digits`, CIFAR-10/100 via torchvision, or any local `.npz`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsynth.config_schema import DATASETS
from fedsynth.errors import DataError

NUM_CLASSES = {"digits": 10, "cifar10": 10, "cifar100": 100}
SPLITS = ("train", "test")
# digits ships as one array; this fixed split (independent of any run seed) gives every node the same test set.
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


@dataclass(frozen=True)
class ArrayDataset:
    """Images as uint8 N x H x W x C and integer labels, with the number of classes."""

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.dtype != np.uint8 or self.x.ndim != 4:
            raise DataError(f"dataset {self.name!r}: x must be uint8 N x H x W x C, got {self.x.dtype} {self.x.shape}")
        if self.y.ndim != 1 or len(self.y) != len(self.x):
            raise DataError(f"dataset {self.name!r}: y must be 1-D with {len(self.x)} labels, got {self.y.shape}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) as models see it."""
        _, h, w, c = self.x.shape
        return (c, h, w)

    def subset(self, indices: np.ndarray) -> "ArrayDataset":
        return ArrayDataset(self.name, self.x[indices], self.y[indices], self.num_classes)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def _digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(y))
    n_test = int(round(len(y) * DIGITS_TEST_FRACTION))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    chosen = np.sort(chosen)
    return x[chosen], y[chosen]


def _npz_path(data_dir: Path, split: str) -> Path | None:
    path = data_dir / f"{split}.npz"
    return path if path.is_file() else None


def _read_npz(path: Path, labels_only: bool) -> tuple[np.ndarray | None, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "y" not in archive.files or (not labels_only and "x" not in archive.files):
                raise DataError(f"{path}: expected arrays 'x' and 'y', found {archive.files}")
            y = archive["y"].astype(np.int64)
            x = None if labels_only else np.ascontiguousarray(archive["x"])
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from exc
    if x is not None and x.ndim == 3:
        x = x[..., None]
    return x, y


def _torchvision_cifar(name: str, split: str, root: Path, download: bool) -> tuple[np.ndarray, np.ndarray]:
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    try:
        ds = cls(root=str(root), train=(split == "train"), download=download)
    except RuntimeError as exc:
        raise DataError(
            f"{name}: no torchvision copy in {root} and download is off ({exc}); "
            f"pass a --data-dir holding {split}.npz or a torchvision folder, or allow download"
        ) from exc
    return np.asarray(ds.data, dtype=np.uint8), np.asarray(ds.targets, dtype=np.int64)


def _resolve_dir(data_dir: str | Path | None) -> Path | None:
    if data_dir is None:
        return None
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"data folder {str(data_dir)!r} does not exist")
    return path


def load_dataset(
    name: str, split: str = "train", *, data_dir: str | Path | None = None, download: bool = False
) -> ArrayDataset:
    """Load a split. CIFAR and npz read `DATA_DIR/{split}.npz` first, then a torchvision folder."""
    x, y = _load(name, split, data_dir=data_dir, download=download, labels_only=False)
    if x is None:
        raise DataError(f"dataset {name!r}: no images were loaded")
    return ArrayDataset(name, x, y, _num_classes(name, y))


def load_labels(name: str, split: str = "train", *, data_dir: str | Path | None = None, download: bool = False) -> np.ndarray:
    """Only the labels (cheap for .npz: the image array is never decompressed)."""
    return _load(name, split, data_dir=data_dir, download=download, labels_only=True)[1]


def num_classes(name: str, labels: np.ndarray) -> int:
    return _num_classes(name, labels)


def _num_classes(name: str, y: np.ndarray) -> int:
    if name in NUM_CLASSES:
        return NUM_CLASSES[name]
    return int(y.max()) + 1 if len(y) else 0


def _load(
    name: str, split: str, *, data_dir: str | Path | None, download: bool, labels_only: bool
) -> tuple[np.ndarray | None, np.ndarray]:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    _check_split(split)
    folder = _resolve_dir(data_dir)
    if name == "digits":
        x, y = _digits(split)
        return (None if labels_only else x), y
    npz = _npz_path(folder, split) if folder is not None else None
    if npz is not None:
        x, y = _read_npz(npz, labels_only)
    elif name == "npz":
        raise DataError(f"dataset 'npz' needs a --data-dir holding {split}.npz (got {str(data_dir)!r})")
    else:
        root = folder or Path.home() / ".cache" / "fedsynth" / name
        x, y = _torchvision_cifar(name, split, root, download)
    if name in NUM_CLASSES and len(y) and (y.min() < 0 or y.max() >= NUM_CLASSES[name]):
        raise DataError(f"{name}: labels must lie in 0..{NUM_CLASSES[name] - 1}, found {y.min()}..{y.max()}")
    return x, y
