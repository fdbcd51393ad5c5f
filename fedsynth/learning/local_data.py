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
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedsynth.errors import DataError
from fedsynth.learning.data import ArrayDataset
from fedsynth.learning.hf_data import read_hf_folder
from fedsynth.learning.image_arrays import checked_image_arrays
from fedsynth.learning.image_cache import DecodedCache, listing_digest
from fedsynth.learning.label_schema import MODE_CHANNELS, SCHEMA_FILE, LabelSchema, read_schema_file, relabel_by_name

if TYPE_CHECKING:
    from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
HF_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")  # what Dataset(Dict).save_to_disk writes
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))  # PIL decodes outside the GIL
IMAGE_FORMATS = ("PNG", "JPEG")  # Pillow tries every format it knows otherwise (EPS would start Ghostscript)
DEFAULT_MAX_IMAGE_PIXELS = 1 << 24  # data.max_image_pixels' default
# What Pillow's decoders raise on a hostile or damaged file, besides DataError: each becomes one line naming the file.
DECODER_ERRORS = (OSError, SyntaxError, ValueError, MemoryError, EOFError, IndexError, KeyError, TypeError,
                  struct.error, zlib.error)


@dataclass(frozen=True)
class FolderRules:
    """What a client folder may hold: its files lie inside `root` (resolved) unless `follow_symlinks`, and an image
    may declare at most `max_image_pixels` (width x height) in its header. `where` names the client in messages."""

    root: Path
    where: str
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    follow_symlinks: bool = False


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
                     cache_dir: Path | None = None, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                     follow_symlinks: bool = False) -> LocalData:
    """Client `client_id`'s data from `path` (None: the coordinator's data.test_dir); every problem is a DataError
    naming the client and the file or field. `max_image_pixels` and `follow_symlinks` are data.max_image_pixels and
    data.follow_symlinks (FolderRules)."""
    root = Path(path).expanduser()
    where = f"client {client_id}" if client_id is not None else "data.test_dir"
    if not root.exists():
        raise DataError(f"{where}: data path {str(path)!r} does not exist")
    rules = FolderRules(root.resolve(), where, max_image_pixels, follow_symlinks)
    digest = _folder_schema_digest(root) or schema.digest()
    if (root.is_file() and root.suffix == ".npz") or (root / "train.npz").is_file():
        train_file = root if root.is_file() else root / "train.npz"
        test_file = None if root.is_file() else root / "test.npz"
        for file in (train_file, test_file):
            if file is not None and file != root and file.is_symlink():
                check_link(file, file.name, rules)
        train, unknown = _read_npz(train_file, schema, where)
        test = _read_npz(test_file, schema, where)[0] if test_file is not None and test_file.is_file() else None
        fmt = "npz"
    elif any((root / marker).is_file() for marker in HF_MARKERS):
        _check_links_below(root, rules)
        train, test, unknown = read_hf_folder(root, schema, where)
        fmt = "hf"
    else:
        train_root = root / "train" if (root / "train").is_dir() else root
        test_root = root / "test" if train_root != root and (root / "test").is_dir() else None
        if root.is_file():
            raise DataError(f"{where}: {root}: expected a folder (train/<class>/ images), an .npz or a datasets folder")
        for split_root in (train_root, test_root):
            if split_root is not None and split_root != root and split_root.is_symlink():
                check_link(split_root, split_root.name, rules)
        train, unknown = _read_image_folder(train_root, schema, rules, cache_dir, "train")
        test = None
        if test_root is not None:
            test, test_unknown = _read_image_folder(test_root, schema, rules, cache_dir, "test")
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

def image_files(train_root: Path, rules: FolderRules) -> list[tuple[str, str]]:
    """(class folder, file name) of every image, in the canonical order: file name, then class folder."""
    found: list[tuple[str, str]] = []
    for folder in _entries(train_root, rules.where):
        if not folder.is_dir():
            continue
        if folder.is_symlink():
            check_link(Path(folder.path), f"{train_root.name}/{folder.name}", rules)
        for entry in _entries(Path(folder.path), rules.where):
            rel = f"{train_root.name}/{folder.name}/{entry.name}"
            if entry.is_symlink():
                check_link(Path(entry.path), rel, rules)
            if not entry.is_file():
                raise DataError(f"{rules.where}: {rel}: a folder inside a class folder "
                                "(expected only PNG or JPEG files)")
            if not entry.name.lower().endswith(IMAGE_SUFFIXES):
                raise DataError(f"{rules.where}: {rel}: not an image (expected PNG or JPEG files: .png, .jpg, .jpeg)")
            found.append((folder.name, entry.name))
    return sorted(found, key=lambda item: (item[1], item[0]))


def _entries(folder: Path, where: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as scan:
            return [entry for entry in scan if not entry.name.startswith(".")]
    except OSError as exc:
        raise DataError(f"{where}: {folder}: cannot list the folder ({exc.strerror or exc})") from None


def check_link(path: Path, rel: str, rules: FolderRules) -> None:
    """Refuse a symbolic link that is broken, loops, or (unless data.follow_symlinks) leaves the client folder."""
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise DataError(f"{rules.where}: {rel}: a broken symbolic link (to {os.readlink(path)!r})") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links, before Python 3.13
        raise DataError(f"{rules.where}: {rel}: an unusable symbolic link ({exc})") from None
    if not rules.follow_symlinks and not target.is_relative_to(rules.root):
        raise DataError(f"{rules.where}: {rel}: a symbolic link to {target}, outside the client folder {rules.root} "
                        "(data.follow_symlinks = true follows it)")


def _check_links_below(folder: Path, rules: FolderRules) -> None:
    """Every symbolic link anywhere under `folder` (a datasets folder: a few files), checked as check_link does."""
    for parent, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            path = Path(parent) / name
            if path.is_symlink():
                check_link(path, str(path.relative_to(folder)), rules)


def _read_image_folder(folder: Path, schema: LabelSchema, rules: FolderRules, cache_dir: Path | None,
                       split: str) -> tuple[ArrayDataset, tuple[str, ...]]:
    files = image_files(folder, rules)
    if not files and split == "train":
        kind = "folder" if rules.where == "data.test_dir" else "client folder"
        raise DataError(f"{rules.where}: {kind} {rules.root} holds no training images: no PNG or JPEG file under "
                        "train/<class name>/ (or <class name>/ directly inside it)")
    index = {name: i for i, name in enumerate(schema.classes)}
    unknown = tuple(sorted({cls for cls, _ in files if cls not in index}))
    files = [(cls, name) for cls, name in files if cls in index]
    labels = np.array([index[cls] for cls, _ in files], dtype=np.int64)
    paths = [folder / cls / name for cls, name in files]
    cache = _cache_for(folder, split, paths, labels, schema, rules, cache_dir) if paths else None
    if cache is not None:
        cached = cache.read()
        if cached is not None and len(cached) == len(labels):
            return ArrayDataset("local", cached, labels, len(schema.classes)), unknown
    x = decode_images(paths, schema, rules, root=folder.parent)
    if cache is not None:
        cache.write(x)
    return ArrayDataset("local", x, labels, len(schema.classes)), unknown


def _cache_for(folder: Path, split: str, paths: Sequence[Path], labels: np.ndarray, schema: LabelSchema,
               rules: FolderRules, cache_dir: Path | None) -> DecodedCache | None:
    """The cache of this folder's split, keyed by the current listing (each file's path, size, mtime, inode and
    ctime, its label) and by what decoding depends on (the schema, the pixel cap)."""
    if cache_dir is None:
        return None
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    try:
        listing = listing_digest(paths, labels, f"{schema.digest()}\tmax_image_pixels={rules.max_image_pixels}")
    except OSError as exc:  # a file removed or made unreadable since it was listed
        raise DataError(f"{rules.where}: {exc.filename}: {exc.strerror or exc}") from None
    return DecodedCache(cache_dir / f"{key}-{split}.npz", listing)


def decode_images(paths: Sequence[Path], schema: LabelSchema, rules: FolderRules, *, root: Path) -> np.ndarray:
    """N x S x S x C uint8. Every image must have the same channel count; if all differ from the schema's, they are
    returned as they are (the coordinator refuses the client at registration, naming data.channels)."""
    if not paths:
        return np.zeros((0, schema.image_size, schema.image_size, schema.channels), np.uint8)
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        decoded = list(pool.map(lambda p: _decode(p, schema.image_size, str(p.relative_to(root)), rules), paths,
                                chunksize=64))
    channels = {image.shape[2] for image in decoded}
    if len(channels) > 1:
        odd = next(p for p, image in zip(paths, decoded) if image.shape[2] != schema.channels)
        found = next(image.shape[2] for image in decoded if image.shape[2] != schema.channels)
        kind = "grayscale" if found == 1 else "RGB"
        raise DataError(f"{rules.where}: {odd.relative_to(root)}: {found} channel(s) ({kind}); "
                        f"data.channels is {schema.channels} and this client's other images have {schema.channels}")
    return np.stack(decoded)


def _decode(path: Path, size: int, rel: str, rules: FolderRules) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path, formats=IMAGE_FORMATS) as image:
            _check_pixels(image.size, rel, rules)  # Image.open read only the header: nothing is decoded yet
            image.load()  # a truncated or corrupt file fails here, not later
            array = _as_array(image, size, rel, rules.where)
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning where it is an error
        raise DataError(f"{rules.where}: {rel}: more pixels than Pillow decodes ({exc}); data.max_image_pixels is "
                        f"{rules.max_image_pixels:,}") from None
    except DECODER_ERRORS as exc:
        raise DataError(f"{rules.where}: {rel}: not a readable PNG or JPEG image ({_one_line(exc)})") from None
    return array[..., None] if array.ndim == 2 else array


def _check_pixels(size: tuple[int, int], rel: str, rules: FolderRules) -> None:
    width, height = size
    if width * height > rules.max_image_pixels:
        raise DataError(f"{rules.where}: {rel}: declares {width}x{height} = {width * height:,} pixels, more than "
                        f"data.max_image_pixels = {rules.max_image_pixels:,} (refused before decoding)")


def _as_array(image: Image.Image, size: int, rel: str, where: str) -> np.ndarray:
    """The loaded image as uint8 H x W [x C] of side `size`: palette to RGB, 1-bit to L, square images resized."""
    from PIL import Image

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
    return np.asarray(image, dtype=np.uint8)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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


def load_test_dir(path: str | Path, schema: LabelSchema, *, cache_dir: Path | None = None,
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, follow_symlinks: bool = False) -> ArrayDataset:
    """The coordinator's own test data (data.test_dir, local mode): <class name>/ folders directly in `path` or under
    `path`/test/, or an .npz; a class folder outside the schema is a DataError naming it."""
    root = Path(path).expanduser()
    source = root / "test" if (root / "test").is_dir() else root
    data = load_client_data(source, schema, client_id=None, cache_dir=cache_dir, max_image_pixels=max_image_pixels,
                            follow_symlinks=follow_symlinks)
    if data.unknown_classes:
        raise DataError(f"data.test_dir: {source} holds classes outside data.classes: {', '.join(data.unknown_classes)}")
    return data.train
