"""Hugging Face `datasets` folders (`save_to_disk`): read a client's, and write one, with an `image` column and a
`label` column whose `ClassLabel` names are matched to the run's schema by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedsynth.errors import DataError
from fedsynth.learning.data import ArrayDataset
from fedsynth.learning.label_schema import MODE_CHANNELS, LabelSchema, relabel_by_name


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("a Hugging Face datasets folder needs the `datasets` package: pip install datasets") from None
    datasets.disable_progress_bars()  # a node's log gets one line per client, not a bar per shard
    return datasets


def read_hf_folder(root: Path, schema: LabelSchema, where: str) -> tuple[ArrayDataset, ArrayDataset | None, tuple[str, ...]]:
    """A DatasetDict (splits train and optionally test) or a single Dataset (train only) saved with save_to_disk."""
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(root))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DataError(f"{where}: {root}: not a readable datasets folder ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{where}: {root}: the datasets folder has splits {list(loaded)}, no 'train'")
        train, test = loaded["train"], loaded.get("test")
    else:
        train, test = loaded, None
    train_set, unknown = _split(train, schema, where, f"{root.name}[train]")
    test_set = _split(test, schema, where, f"{root.name}[test]")[0] if test is not None else None
    return train_set, test_set, unknown


def _split(dataset: Any, schema: LabelSchema, where: str, name: str) -> tuple[ArrayDataset, tuple[str, ...]]:
    for column in ("image", "label"):
        if column not in dataset.column_names:
            raise DataError(f"{where}: {name}: no column {column!r} (found {dataset.column_names})")
    feature = dataset.features["label"]
    names = getattr(feature, "names", None)
    if not names:
        raise DataError(f"{where}: {name}: field label is not a ClassLabel with class names")
    images = []
    for row, image in enumerate(dataset["image"]):
        if image.mode in ("P", "1"):
            image = image.convert("RGB" if image.mode == "P" else "L")
        if image.mode not in MODE_CHANNELS:
            raise DataError(f"{where}: {name}: row {row}: image mode {image.mode} (expected L or RGB)")
        if image.size != (schema.image_size, schema.image_size):
            if image.width != image.height:
                raise DataError(f"{where}: {name}: row {row}: {image.width}x{image.height} is not square")
            image = image.resize((schema.image_size, schema.image_size))
        array = np.asarray(image, dtype=np.uint8)
        images.append(array[..., None] if array.ndim == 2 else array)
    if len({image.shape[2] for image in images}) > 1:
        raise DataError(f"{where}: {name}: field image: grayscale and RGB images mixed; data.channels is {schema.channels}")
    x = np.stack(images) if images else np.zeros((0, schema.image_size, schema.image_size, schema.channels), np.uint8)
    return relabel_by_name(x, np.asarray(dataset["label"], dtype=np.int64), names, schema)


def write_hf_folder(folder: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], classes: tuple[str, ...]) -> None:
    """Save {split: (x uint8 N x H x W x C, y)} as a DatasetDict with an Image column and a ClassLabel column."""
    datasets = _datasets()
    from PIL import Image

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classes))})
    parts = {}
    for split, (x, y) in splits.items():
        pictures = [Image.fromarray(image[..., 0] if image.shape[2] == 1 else image) for image in x]
        parts[split] = datasets.Dataset.from_dict({"image": pictures, "label": [int(v) for v in y]}, features=features)
    datasets.DatasetDict(parts).save_to_disk(str(folder))
