"""A local-mode federation's client folders pooled into one dataset, for the operator of a test bench who holds them
all (training a generator on the clients' images, a judge scoring it). A run never does this: each node reads only
its own folder."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fedsynth.errors import DataError
from fedsynth.learning.data import ArrayDataset
from fedsynth.learning.label_schema import SCHEMA_FILE, LabelSchema, read_schema_file
from fedsynth.learning.local_data import load_client_data

CLIENT_FOLDER = re.compile(r"client-(\d+)")


def client_folders(root: Path) -> list[tuple[int, Path]]:
    """ROOT's client-<k>/ folders as (k, folder) in client order; a DataError naming ROOT when it holds none."""
    if not root.is_dir():
        raise DataError(f"--data {str(root)!r} is not a folder of client-<k>/ folders")
    found = sorted((int(match.group(1)), path) for path in root.iterdir()
                   if path.is_dir() and (match := CLIENT_FOLDER.fullmatch(path.name)))
    if not found:
        raise DataError(f"--data {str(root)!r} holds no client-<k>/ folders (`fedsynth data split` writes them)")
    return found


def folder_schema(root: Path, schema_file: Path | None) -> LabelSchema:
    """The schema to read ROOT's client folders with: SCHEMA_FILE given, else ROOT/schema.toml."""
    client_folders(root)  # a folder of no clients is named as that, not as a missing schema
    path = schema_file if schema_file is not None else root / SCHEMA_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist: pass --schema FILE ([data] classes, image_size, channels)")
    return read_schema_file(path)


def pooled(root: Path, schema: LabelSchema, split: str) -> ArrayDataset:
    """Every client's `split` images ("train" or "test", whichever a folder has) at the schema's size, in client order."""
    parts = []
    for client_id, folder in client_folders(root):
        data = load_client_data(folder, schema, client_id=client_id)
        chosen = data.train if split == "train" else data.test
        if chosen is not None:
            parts.append(chosen)
    classes = len(schema.classes)
    if not parts or not sum(len(part.y) for part in parts):
        raise DataError(f"--data {str(root)!r}: the client folders hold no {split} images")
    return ArrayDataset(f"folders:{root.name}", np.concatenate([part.x for part in parts]),
                        np.concatenate([part.y for part in parts]), classes)
