"""The `holdout` backend: a perfect generator that serves REAL held-out training images of the requested class.

It measures allocation alone, apart from generator quality. The pool is `holdout_split(labels, fraction, seed)[1]`
of the training split: the same split the coordinator and clients compute from the run's data config, so no data
is exchanged and no image from a client's partition is ever served.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedsynth.learning.data import load_dataset
from fedsynth.errors import ConfigError
from fedsynth.learning.label_schema import SCHEMA_FILE, read_schema_file
from fedsynth.learning.local_data import load_client_data
from fedsynth.learning.partition import holdout_split
from generator_service.backends import BackendDescription, BackendSettings, BackendSpec, Unservable

if TYPE_CHECKING:
    from generator_service.ddpm.sampling import ImageKey

# Extra SeedSequence words: keep the permutation and the with-replacement draws apart from each other.
PERMUTATION_TAG = 0x5E1F
REPLACEMENT_TAG = 0x5E20
NO_VARIATIONS = "the holdout backend serves real images and makes no variations"


class HoldoutBackend:
    """Image j of class c for seed s is a pure function of (s, c, j): with n_c held-out images of class c and
    perm a permutation of them seeded by (s, c), j < n_c -> perm[j] (no repeats while the class lasts), and
    j >= n_c -> a uniform draw seeded by (s, c, j) (with replacement). So offsets resume exactly, as for ddpm."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, holdout: np.ndarray, num_classes: int,
                 description: BackendDescription) -> None:
        self._images = images  # the whole training split, N x H x W x C uint8; only `holdout` rows are ever read
        self._members = [holdout[labels[holdout] == c] for c in range(num_classes)]  # sorted indices per class
        self._description = description
        self._permutation = functools.lru_cache(maxsize=4096)(self._permute)

    @property
    def description(self) -> BackendDescription:
        return self._description

    def held_out(self, class_id: int) -> np.ndarray:
        """Training-split indices of the held-out images of one class (sorted)."""
        return self._members[class_id]

    def _permute(self, seed: int, class_id: int) -> np.ndarray:
        count = len(self._members[class_id])
        return np.random.default_rng([seed, class_id, PERMUTATION_TAG]).permutation(count)

    def source_index(self, key: ImageKey) -> int:
        """The training-split index of the image served for this key."""
        members = self._members[key.class_id]
        if len(members) == 0:
            raise Unservable(self._empty_message(key.class_id))
        if key.index < len(members):
            return int(members[self._permutation(key.seed, key.class_id)[key.index]])
        draw = np.random.default_rng([key.seed, key.class_id, key.index, REPLACEMENT_TAG]).integers(len(members))
        return int(members[draw])

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        from generator_service.ddpm.sampling import VariationKey

        if any(isinstance(key, VariationKey) for key in keys):  # the servicer refuses Vary first; never a silent image
            raise Unservable(NO_VARIATIONS)
        return self._images[[self.source_index(key) for key in keys]]

    def check_variations(self) -> None:
        raise Unservable(NO_VARIATIONS)

    def check_counts(self, counts: Sequence[int]) -> None:
        for class_id, count in enumerate(counts):
            if count and len(self._members[class_id]) == 0:
                raise Unservable(self._empty_message(class_id))

    def _empty_message(self, class_id: int) -> str:
        return (f"class {class_id} has no held-out image in {self._description.model_id}; "
                f"raise the holdout fraction or request no images of class {class_id}")


def load_holdout(dataset: str, *, fraction: float, seed: int, data_dir: str | Path | None = None) -> HoldoutBackend:
    """Load the training split of `dataset` and serve its seeded stratified hold-out share `fraction`."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"the holdout backend needs a holdout fraction in (0, 1), got {fraction}")
    if seed < 0:
        raise ConfigError(f"the holdout backend needs a seed >= 0, got {seed}")
    train = load_dataset(dataset, "train", data_dir=data_dir)
    _, holdout = holdout_split(train.y, fraction, seed)
    digest = hashlib.sha256(holdout.astype("<i8").tobytes())
    digest.update(np.ascontiguousarray(train.x[holdout]).tobytes())
    digest.update(train.y[holdout].astype("<i8").tobytes())
    description = BackendDescription(
        backend="holdout", model_id=f"holdout-{dataset}-f{fraction:g}-s{seed}-{digest.hexdigest()[:12]}",
        dataset=dataset, num_classes=train.num_classes, image_shape=train.image_shape, device="cpu", dtype="uint8",
    )
    return HoldoutBackend(train.x, train.y, holdout, train.num_classes, description)


def load_holdout_folder(folder: Path) -> HoldoutBackend:
    """Serve a folder of held-out images as `fedsynth data split --holdout-fraction` writes it (OUT/holdout, its
    schema.toml beside it): its images in the loader's canonical order, which for data split's folders is the order of
    split mode's hold-out, so class c's j-th image for seed s is the one split mode serves."""
    schema_file = next((f / SCHEMA_FILE for f in (folder, folder.parent) if (f / SCHEMA_FILE).is_file()), None)
    if schema_file is None:
        raise ConfigError(f"--holdout-dir {str(folder)!r}: no {SCHEMA_FILE} in it or beside it (names the classes)")
    schema = read_schema_file(schema_file)
    held = load_client_data(folder, schema, client_id=-1)
    if held.unknown_classes:
        raise ConfigError(f"--holdout-dir {str(folder)!r}: classes {list(held.unknown_classes)} are not in {schema_file}")
    train = held.train
    digest = hashlib.sha256(np.ascontiguousarray(train.x).tobytes())
    digest.update(train.y.astype("<i8").tobytes())
    description = BackendDescription(
        backend="holdout", model_id=f"holdout-local-{digest.hexdigest()[:12]}", dataset="local",
        num_classes=len(schema.classes), image_shape=train.image_shape, device="cpu", dtype="uint8",
    )
    return HoldoutBackend(train.x, train.y, np.arange(len(train.y)), len(schema.classes), description)


def _load(config: BackendSettings) -> HoldoutBackend:
    if config.holdout_dir is not None:
        return load_holdout_folder(config.holdout_dir)
    assert config.dataset is not None and config.holdout_fraction is not None and config.seed is not None
    return load_holdout(config.dataset, fraction=config.holdout_fraction, seed=config.seed, data_dir=config.data_dir)


BACKEND = BackendSpec("holdout", load=_load)
