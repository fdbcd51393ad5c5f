"""A client's own data from its folder (ImageFolder, .npz or a Hugging Face `save_to_disk` folder), labelled by
class NAME against the run's label schema, in a canonical order, decoded once and cached.

Canonical order (what makes local mode over `fedsynth data split`'s folders train exactly as split mode): a client's
images are ordered by file name alone (not the class folder), ties broken by the class folder's name. `data split`
names every file by its index in the dataset's split (`000123.png`), so this order is the sorted shard of split mode.
An .npz or a Hugging Face folder keeps its rows in the order they are stored.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsynth.errors import DataError
from fedsynth.learning.data import ArrayDataset
from fedsynth.learning.hf_data import read_hf_folder
from fedsynth.learning.image_arrays import checked_image_arrays
from fedsynth.learning.image_cache import DecodedCache, listing_digest
from fedsynth.learning.label_schema import MODE_CHANNELS, SCHEMA_FILE, LabelSchema, read_schema_file, relabel_by_name

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
HF_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")  # what Dataset(Dict).save_to_disk writes
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))  # PIL decodes outside the GIL


@dataclass(frozen=True)
class LocalData:
    """What a client loaded: its training images, its own test images (None without a test split), the class names it
    holds that the schema lacks (their images are left out; the coordinator refuses such a client), and the digest of
    the schema its folder was written for (the folder's schema.toml, else the run's)."""

    train: ArrayDataset
    test: ArrayDataset | None
    unknown_classes: tuple[str, ...]
    schema_digest: str
    format: str


def load_client_data(path: str | Path, schema: LabelSchema, *, client_id: int | None, min_size: int = 0,
                     cache_dir: Path | None = None) -> LocalData:
    """Client `client_id`'s data from `path` (None: the coordinator's data.test_dir); every problem is a DataError
    naming the client and the file or field."""
    root = Path(path).expanduser()
    where = f"client {client_id}" if client_id is not None else "data.test_dir"
    if not root.exists():
        raise DataError(f"{where}: data path {str(path)!r} does not exist")
    digest = _folder_schema_digest(root) or schema.digest()
    if (root.is_file() and root.suffix == ".npz") or (root / "train.npz").is_file():
        train_file = root if root.is_file() else root / "train.npz"
        test_file = None if root.is_file() else root / "test.npz"
        train, unknown = _read_npz(train_file, schema, where)
        test = _read_npz(test_file, schema, where)[0] if test_file is not None and test_file.is_file() else None
        fmt = "npz"
    elif any((root / marker).is_file() for marker in HF_MARKERS):
        train, test, unknown = read_hf_folder(root, schema, where)
        fmt = "hf"
    else:
        train_root = root / "train" if (root / "train").is_dir() else root
        test_root = root / "test" if train_root != root and (root / "test").is_dir() else None
        if root.is_file():
            raise DataError(f"{where}: {root}: expected a folder (train/<class>/ images), an .npz or a datasets folder")
        train, unknown = _read_image_folder(train_root, schema, where, cache_dir, "train")
        test = None
        if test_root is not None:
            test, test_unknown = _read_image_folder(test_root, schema, where, cache_dir, "test")
            unknown = tuple(sorted({*unknown, *test_unknown}))
        fmt = "imagefolder"
    if len(train.y) == 0 and not unknown:
        raise DataError(f"{where}: {root} holds no training images")
    if len(train.y) < min_size and not unknown:
        raise DataError(f"{where}: {root} holds {len(train.y)} training images; data.min_size is {min_size}")
    return LocalData(train, test, unknown, digest, fmt)


def _folder_schema_digest(root: Path) -> str:
    for folder in (root if root.is_dir() else root.parent, root.parent if root.is_dir() else root.parent.parent):
        if (folder / SCHEMA_FILE).is_file():
            return read_schema_file(folder / SCHEMA_FILE).digest()
    return ""


# ---- ImageFolder ---------------------------------------------------------------------------------

def image_files(train_root: Path, where: str) -> list[tuple[str, str]]:
    """(class folder, file name) of every image, in the canonical order: file name, then class folder."""
    found: list[tuple[str, str]] = []
    folders = [entry for entry in os.scandir(train_root) if entry.is_dir() and not entry.name.startswith(".")]
    for folder in folders:
        for entry in os.scandir(folder.path):
            if entry.name.startswith("."):
                continue
            rel = f"{train_root.name}/{folder.name}/{entry.name}"
            if not entry.is_file():
                raise DataError(f"{where}: {rel}: a folder inside a class folder (expected only PNG or JPEG files)")
            if not entry.name.lower().endswith(IMAGE_SUFFIXES):
                raise DataError(f"{where}: {rel}: not an image (expected PNG or JPEG files: .png, .jpg, .jpeg)")
            found.append((folder.name, entry.name))
    return sorted(found, key=lambda item: (item[1], item[0]))


def _read_image_folder(folder: Path, schema: LabelSchema, where: str, cache_dir: Path | None,
                       split: str) -> tuple[ArrayDataset, tuple[str, ...]]:
    files = image_files(folder, where)
    index = {name: i for i, name in enumerate(schema.classes)}
    unknown = tuple(sorted({cls for cls, _ in files if cls not in index}))
    files = [(cls, name) for cls, name in files if cls in index]
    labels = np.array([index[cls] for cls, _ in files], dtype=np.int64)
    paths = [folder / cls / name for cls, name in files]
    cache = None
    if cache_dir is not None:
        key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        cache = DecodedCache(cache_dir / f"{key}-{split}.npz", listing_digest(paths, labels, schema.digest()))
        cached = cache.read()
        if cached is not None:
            return ArrayDataset("local", cached, labels, len(schema.classes)), unknown
    x = decode_images(paths, schema, where, root=folder.parent)
    if cache is not None:
        cache.write(x)
    return ArrayDataset("local", x, labels, len(schema.classes)), unknown


def decode_images(paths: Sequence[Path], schema: LabelSchema, where: str, *, root: Path) -> np.ndarray:
    """N x S x S x C uint8. Every image must have the same channel count; if all differ from the schema's, they are
    returned as they are (the coordinator refuses the client at registration, naming data.channels)."""
    if not paths:
        return np.zeros((0, schema.image_size, schema.image_size, schema.channels), np.uint8)
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        decoded = list(pool.map(lambda p: _decode(p, schema.image_size, where, root), paths, chunksize=64))
    channels = {image.shape[2] for image in decoded}
    if len(channels) > 1:
        odd = next(p for p, image in zip(paths, decoded) if image.shape[2] != schema.channels)
        found = next(image.shape[2] for image in decoded if image.shape[2] != schema.channels)
        raise DataError(f"{where}: {odd.relative_to(root)}: {found} channel(s) ({'grayscale' if found == 1 else 'RGB'}); "
                        f"data.channels is {schema.channels} and this client's other images have {schema.channels}")
    return np.stack(decoded)


def _decode(path: Path, size: int, where: str, root: Path) -> np.ndarray:
    from PIL import Image

    rel = path.relative_to(root)
    try:
        with Image.open(path) as image:
            image.load()  # a truncated or corrupt file fails here, not later
            if image.mode in ("P", "1"):
                image = image.convert("RGB" if image.mode == "P" else "L")
            if image.mode not in MODE_CHANNELS:
                raise DataError(f"{where}: {rel}: image mode {image.mode} (expected grayscale L or RGB; "
                                "save it without alpha or 16-bit depth)")
            if image.size != (size, size):
                if image.width != image.height:
                    raise DataError(f"{where}: {rel}: {image.width}x{image.height} is not square; data.image_size = "
                                    f"{size} resizes square images only")
                image = image.resize((size, size), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except DataError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: {rel}: not a readable PNG or JPEG image ({exc})") from None
    return array[..., None] if array.ndim == 2 else array


# ---- .npz ----------------------------------------------------------------------------------------

def _read_npz(path: Path, schema: LabelSchema, where: str) -> tuple[ArrayDataset, tuple[str, ...]]:
    """x (uint8 N x H x W [x C]), y (labels into `classes`) and classes (the file's class names, label order)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("x", "y", "classes") if key not in archive.files]
            if missing:
                raise DataError(f"{where}: {path.name}: no array {missing[0]!r} (expected x, y and classes)")
            x, y, names = archive["x"], archive["y"], [str(n) for n in archive["classes"]]
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: {path.name}: not a readable .npz file ({exc})") from None
    x, y = checked_image_arrays(x, y, f"{where}: {path.name}")
    if x.shape[1:3] != (schema.image_size, schema.image_size):
        raise DataError(f"{where}: {path.name}: field x: images are {x.shape[1]}x{x.shape[2]}, data.image_size is "
                        f"{schema.image_size} (arrays in an .npz are not resized)")
    bad = np.flatnonzero((y < 0) | (y >= len(names)))
    if len(bad):
        raise DataError(f"{where}: {path.name}: field y: label {int(y[bad[0]])} at row {int(bad[0])} is outside the "
                        f"file's {len(names)} class names")
    return relabel_by_name(np.ascontiguousarray(x), y.astype(np.int64), names, schema)


def load_test_dir(path: str | Path, schema: LabelSchema, *, cache_dir: Path | None = None) -> ArrayDataset:
    """The coordinator's own test data (data.test_dir, local mode): <class name>/ folders directly in `path` or under
    `path`/test/, or an .npz; a class folder outside the schema is a DataError naming it."""
    root = Path(path).expanduser()
    source = root / "test" if (root / "test").is_dir() else root
    data = load_client_data(source, schema, client_id=None, cache_dir=cache_dir)
    if data.unknown_classes:
        raise DataError(f"data.test_dir: {source} holds classes outside data.classes: {', '.join(data.unknown_classes)}")
    return data.train
