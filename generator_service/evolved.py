"""A generator folder written by `fedsynth generator evolve`: the public model's files plus `evolved.npz`, the
population Private Evolution selected. Served by class counts: image j < M of class c is the evolved set's image
perm(seed, c)[j]; beyond M, a variation (SDEdit, the run's last strength) of evolved image perm(seed, c)[j mod M]."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedsynth.errors import ConfigError
from generator_service.backends import BackendDescription
from generator_service.ddpm.grid import save_image_grid
from generator_service.ddpm.model import read_metadata
from generator_service.ddpm.sampling import ImageKey, VariationKey

EVOLVED_FILE = "evolved.npz"
PERMUTATION_TAG = 0xE7


def evolved_model_id(folder: Path, public_model_id: str) -> str:
    """The evolved set's id: its bytes' hash beside the public model's id (the same weights make its variations)."""
    digest = hashlib.sha256((folder / EVOLVED_FILE).read_bytes()).hexdigest()[:12]
    return f"evolved-{digest}-{public_model_id}"


def read_evolved(folder: Path, *, num_classes: int, image_shape: tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """(uint8 (C*M) x H x W x C images, class-major, and M) from folder/evolved.npz, checked against the model's shape."""
    path = folder / EVOLVED_FILE
    try:
        with np.load(path, allow_pickle=False) as archive:
            x, y = archive["x"], archive["y"]
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"{path}: not an evolved set ({exc})") from None
    channels, height, width = image_shape
    per_class = len(y) // num_classes if num_classes else 0
    if (x.dtype != np.uint8 or x.shape[1:] != (height, width, channels) or per_class < 1 or len(x) != len(y)
            or not np.array_equal(y, np.repeat(np.arange(num_classes), per_class))):
        raise ConfigError(f"{path}: expected uint8 images of {(height, width, channels)}, the same number of each of "
                          f"{num_classes} classes in class order; got {x.dtype} {x.shape} with {len(y)} labels")
    return x, per_class


class EvolvedBackend:
    """Wraps the public model's DdpmBackend: serves the evolved set, and variations of it beyond its size."""

    def __init__(self, public: object, images: np.ndarray, per_class: int, strength: float) -> None:
        self.public = public  # its description already names the evolved folder's model_id (and the sampling settings)
        self.images = images
        self.per_class = per_class
        self.strength = strength
        self._order = functools.lru_cache(maxsize=1024)(self._permute)

    @property
    def description(self) -> BackendDescription:
        return self.public.description  # type: ignore[attr-defined, no-any-return]

    def _permute(self, seed: int, class_id: int) -> np.ndarray:
        return np.random.default_rng([seed, class_id, PERMUTATION_TAG]).permutation(self.per_class)

    def check_counts(self, counts: Sequence[int]) -> None:
        return None

    def check_variations(self) -> None:
        return None  # Vary goes to the public model's SDEdit

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        out = np.empty((len(keys), *self.images.shape[1:]), dtype=np.uint8)
        varied: list[tuple[int, ImageKey]] = []
        for row, key in enumerate(keys):
            if isinstance(key, VariationKey):
                varied.append((row, key))
                continue
            source = self.images[key.class_id * self.per_class + int(self._order(key.seed, key.class_id)[key.index % self.per_class])]
            if key.index < self.per_class:
                out[row] = source
            else:
                varied.append((row, VariationKey(key.seed, key.class_id, key.index, source=source.tobytes(), strength=self.strength)))
        if varied:
            out[[row for row, _ in varied]] = self.public.sample([key for _, key in varied])  # type: ignore[attr-defined]
        return out


def wrap_if_evolved(folder: Path, backend: object) -> object:
    """The backend as loaded, or the evolved set over it when the folder holds one."""
    if not (folder / EVOLVED_FILE).is_file():
        return backend
    meta = read_metadata(folder)
    evolved = meta.extra.get("evolved")
    if not isinstance(evolved, dict) or not 0 < float(evolved.get("strength", 0)) <= 1:
        raise ConfigError(f"{folder}: {EVOLVED_FILE} without an \"evolved\" record (strength) in its metadata")
    images, per_class = read_evolved(folder, num_classes=meta.num_classes, image_shape=meta.image_shape)
    return EvolvedBackend(backend, images, per_class, float(evolved["strength"]))


def save_class_grid_of(images: np.ndarray, labels: np.ndarray, path: Path, *, per_class: int) -> Path:
    """The first per_class images of every class, a row per class."""
    classes = int(labels.max()) + 1
    rows = [images[labels == c][:per_class] for c in range(classes)]
    per_class = min(per_class, *(len(r) for r in rows))
    return save_image_grid(np.concatenate([r[:per_class] for r in rows]), path, num_classes=classes, per_class=per_class)
