"""The federation's label schema (class names in label order, image size, channels), its digest, and relabelling by
class name (never by position: a client lacking a class must not shift the later labels)."""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsynth.config import DataConfig
from fedsynth.errors import DataError
from fedsynth.learning.data import ArrayDataset

SCHEMA_FILE = "schema.toml"  # written by `fedsynth data split` beside the client folders
MODE_CHANNELS = {"L": 1, "RGB": 3}  # PIL modes taken as they are; "P" and "1" are converted first (no data lost)


@dataclass(frozen=True)
class LabelSchema:
    """The federation's classes (list order = label index) and image shape; its digest is what clients send."""

    classes: tuple[str, ...]
    image_size: int
    channels: int

    def digest(self) -> str:
        text = json.dumps({"classes": list(self.classes), "image_size": self.image_size, "channels": self.channels})
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_toml(self) -> str:
        names = ", ".join(json.dumps(name) for name in self.classes)
        return f"[data]\nclasses = [{names}]\nimage_size = {self.image_size}\nchannels = {self.channels}\n"


def schema_of(d: DataConfig) -> LabelSchema | None:
    """The run's schema (data.classes/image_size/channels, else the built-in dataset's); None where npz leaves it open."""
    classes, image_size, channels = d.schema()
    if classes is None or image_size is None or channels is None:
        return None
    return LabelSchema(tuple(classes), image_size, channels)


def read_schema_file(path: Path) -> LabelSchema:
    try:
        table = tomllib.loads(path.read_text())["data"]
        return LabelSchema(tuple(str(c) for c in table["classes"]), int(table["image_size"]), int(table["channels"]))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a schema file ([data] classes, image_size, channels): {exc}") from exc


def relabel_by_name(x: np.ndarray, y: np.ndarray, names: Sequence[str], schema: LabelSchema) -> tuple[ArrayDataset, tuple[str, ...]]:
    """Relabel rows from their own class names onto the schema's indices; rows of classes the schema lacks go."""
    index = {name: i for i, name in enumerate(schema.classes)}
    mapping = np.array([index.get(name, -1) for name in names], dtype=np.int64)
    labels = mapping[y] if len(y) else y
    unknown = tuple(sorted({names[i] for i in np.unique(y) if mapping[i] < 0}))
    keep = labels >= 0
    return ArrayDataset("local", x[keep], labels[keep], len(schema.classes)), unknown
