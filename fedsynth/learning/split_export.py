"""Per-client folders cut from one dataset with split mode's shards: `client-<k>/` (train and test), `holdout/` and
`schema.toml`, as ImageFolder PNGs, .npz files or Hugging Face `save_to_disk` folders.

Every file is named by its row in the dataset's split (`000123.png`): the loader's canonical order (file name, then
class folder) is then the sorted shard split mode trains on. A client's test images: each class's test images are
dealt to the clients in proportion to their training counts of that class (seeded), so every client is tested on
its own label mix and the clients' test sets together are the whole test split (less classes no client holds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsynth.config import DataConfig
from fedsynth.errors import ConfigError
from fedsynth.learning.data import ArrayDataset, load_dataset
from fedsynth.learning.hf_data import write_hf_folder
from fedsynth.learning.label_schema import SCHEMA_FILE, LabelSchema
from fedsynth.learning.partition import holdout_split, label_counts, partition_for

TEST_DEAL_TAG = 0x7E57  # the test deal's own random stream, apart from the partition's and the hold-out's


@dataclass(frozen=True)
class SplitRequest:
    data: DataConfig  # dataset, data_dir, clients, partition, alpha, min_size, holdout_fraction: split mode's keys
    seed: int
    format: str
    out: Path
    image_size: int | None = None  # resize every image to this side (bilinear, as local mode resizes); None keeps it


def deal_test(test_labels: np.ndarray, counts: np.ndarray, seed: int) -> list[np.ndarray]:
    """Test indices per client: class c's test images cut in proportion to the clients' training counts n_k^c."""
    num_clients, num_classes = counts.shape
    rng = np.random.default_rng([seed, TEST_DEAL_TAG])
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(test_labels == c))
        share = counts[:, c].astype(np.float64)
        if share.sum() == 0:
            continue
        cuts = np.floor(np.cumsum(share)[:-1] / share.sum() * len(members)).astype(int)
        for k, piece in enumerate(np.split(members, cuts)):
            parts[k].append(piece)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def write_split(request: SplitRequest, schema: LabelSchema) -> dict[str, object]:
    """Write the folders; returns what schema.toml's [split] table records."""
    d, out = request.data, request.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty folder")
    train = load_dataset(d.dataset, "train", data_dir=d.data_dir, download=d.download)
    test = load_dataset(d.dataset, "test", data_dir=d.data_dir, download=d.download)
    if request.image_size is not None:
        train, test = resized(train, request.image_size), resized(test, request.image_size)
    if train.num_classes != len(schema.classes) or train.image_shape != (schema.channels, schema.image_size, schema.image_size):
        raise ConfigError(f"--dataset {d.dataset}: {train.num_classes} classes of {train.image_shape} images, but the schema "
                          f"names {len(schema.classes)} classes of {(schema.channels, schema.image_size, schema.image_size)}")
    parts = partition_for(d, request.seed, train.y)  # split mode's shards, exactly
    counts = label_counts(train.y, parts, train.num_classes)
    tests = deal_test(test.y, counts, request.seed)
    out.mkdir(parents=True, exist_ok=True)
    for k, (part, test_part) in enumerate(zip(parts, tests)):
        _write_client(out / f"client-{k}", {"train": (train, part), "test": (test, test_part)}, schema, request.format)
    _, held = holdout_split(train.y, d.holdout_fraction, request.seed)
    if len(held):
        _write_client(out / "holdout", {"train": (train, held)}, schema, request.format)
    provenance: dict[str, object] = {
        "dataset": d.dataset, "clients": d.clients, "partition": d.partition, "alpha": d.alpha, "min_size": d.min_size,
        "holdout_fraction": d.holdout_fraction, "seed": request.seed, "format": request.format,
        "resized_to": request.image_size or 0,
        "train_counts": counts.tolist(),
    }
    (out / SCHEMA_FILE).write_text(schema.to_toml() + "\n[split]\n" + "".join(
        f"{key} = {json.dumps(value)}\n" for key, value in provenance.items()))
    return provenance


def resized(data: ArrayDataset, size: int) -> ArrayDataset:
    """Every image resized to size x size with PIL's bilinear filter, the one local mode resizes a folder's images with."""
    from PIL import Image

    if data.x.shape[1:3] == (size, size):
        return data
    squeeze = data.x.shape[3] == 1
    rows = [np.asarray(Image.fromarray(image[..., 0] if squeeze else image).resize((size, size), Image.Resampling.BILINEAR))
            for image in data.x]
    x = np.stack(rows)[..., None] if squeeze else np.stack(rows)
    return ArrayDataset(data.name, x.astype(np.uint8), data.y, data.num_classes)


def _write_client(folder: Path, splits: dict[str, tuple[ArrayDataset, np.ndarray]], schema: LabelSchema, fmt: str) -> None:
    folder.mkdir(parents=True)
    if fmt == "npz":
        for split, (data, rows) in splits.items():
            np.savez_compressed(folder / f"{split}.npz", x=data.x[rows], y=data.y[rows], classes=np.array(schema.classes))
    elif fmt == "hf":
        write_hf_folder(folder, {split: (data.x[rows], data.y[rows]) for split, (data, rows) in splits.items()}, schema.classes)
    else:
        from PIL import Image

        for split, (data, rows) in splits.items():
            for name in schema.classes:
                (folder / split / name).mkdir(parents=True)
            for row in rows.tolist():
                image = data.x[row]
                Image.fromarray(image[..., 0] if image.shape[2] == 1 else image).save(
                    folder / split / schema.classes[int(data.y[row])] / f"{row:06d}.png")
