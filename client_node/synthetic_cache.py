"""A persistent, verified cache of one client's synthetic images: per class, a contiguous run of parts.

Each part is an `.npy` file written atomically and listed in `manifest.json` with its SHA-256. Loading
keeps, per class, the longest prefix of parts that are present and intact and forgets the rest, so a
corrupt or partial cache is completed from the right offsets, never silently used.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from fedsynth.process.runtime import write_atomic, write_json

log = logging.getLogger(__name__)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class SyntheticCache:
    def __init__(self, folder: Path, *, identity: dict[str, Any], num_classes: int) -> None:
        self.folder = folder
        self.identity = identity  # generator model id, seed, image shape: a change invalidates the cache
        self.num_classes = num_classes
        self.parts: dict[int, list[dict[str, Any]]] = {c: [] for c in range(num_classes)}
        self._load()

    @property
    def have(self) -> np.ndarray:
        return np.array([sum(p["count"] for p in self.parts[c]) for c in range(self.num_classes)], dtype=np.int64)

    def _load(self) -> None:
        manifest = self.folder / "manifest.json"
        if not manifest.is_file():
            return
        try:
            content = json.loads(manifest.read_text())
        except (OSError, ValueError):
            log.warning("%s: unreadable manifest; starting the cache again", manifest)
            return
        if content.get("identity") != self.identity:
            log.info("%s: made by another generator or seed; starting the cache again", self.folder)
            return
        for c in range(self.num_classes):
            expected = 0
            for part in sorted(content.get("parts", {}).get(str(c), []), key=lambda p: p["first"]):
                path = self.folder / part["file"]
                if part["first"] != expected or not path.is_file() or _sha256_file(path) != part["sha256"]:
                    log.warning("%s: class %d part at %d is missing or corrupt; regenerating from there", self.folder, c, expected)
                    break
                self.parts[c].append(part)
                expected += part["count"]

    def _save_manifest(self) -> None:
        write_json(self.folder / "manifest.json", {"identity": self.identity, "parts": {str(c): p for c, p in self.parts.items()}})

    def append(self, class_id: int, first: int, images: np.ndarray) -> None:
        """Store images first .. first+len-1 of one class; they must continue the class's contiguous run."""
        if first != int(self.have[class_id]):
            raise ValueError(f"class {class_id}: images from index {first} do not continue the cached {self.have[class_id]}")
        self.folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(images, dtype=np.uint8), allow_pickle=False)
        data = buffer.getvalue()
        name = f"class{class_id:03d}-{first:07d}.npy"
        write_atomic(self.folder / name, data)
        self.parts[class_id].append({"file": name, "first": first, "count": len(images), "sha256": hashlib.sha256(data).hexdigest()})
        self._save_manifest()

    def images(self, quota: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first quota[c] cached images of every class, as (uint8 N x H x W x C, int64 labels)."""
        xs, ys = [], []
        for c in range(self.num_classes):
            remaining = int(quota[c])
            for part in self.parts[c]:
                if remaining <= 0:
                    break
                block = np.load(self.folder / part["file"], allow_pickle=False)[:remaining]
                xs.append(block)
                ys.append(np.full(len(block), c, dtype=np.int64))
                remaining -= len(block)
            if remaining > 0:
                raise ValueError(f"class {c}: cache holds {self.have[c]} images, {int(quota[c])} needed")
        if not xs:
            return np.zeros((0, 0, 0, 0), dtype=np.uint8), np.zeros(0, dtype=np.int64)
        return np.concatenate(xs), np.concatenate(ys)
