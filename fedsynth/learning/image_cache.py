"""The decoded-image cache of a client's folder: one uncompressed .npz per folder and split (no pickle), valid while the
folder's listing (names, sizes, modification and change times, inodes, labels, schema) is unchanged, its pixels checked
by SHA-256."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def listing_digest(paths: Sequence[Path], labels: np.ndarray, context: str) -> str:
    """What the decoded array depends on: each file's path (its class folder), size, mtime, inode and ctime, its label,
    and `context` (the schema's digest, the decoding limits). A file replaced with one of the same size and a copied
    mtime (cp -p, rsync -t, an unpacked archive) still differs in its inode or ctime, which no tool sets back."""
    h = hashlib.sha256(context.encode())
    for path, label in zip(paths, labels.tolist()):
        stat = os.stat(path)
        h.update(f"{str(path)!r}\t{stat.st_size}\t{stat.st_mtime_ns}\t{stat.st_dev}:{stat.st_ino}\t{stat.st_ctime_ns}"
                 f"\t{label}\n".encode())
    return h.hexdigest()


def _pixels_digest(x: np.ndarray) -> str:
    h = hashlib.sha256(str(x.shape).encode())
    h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)  # flat: a zero-size array hashes too
    return h.hexdigest()


class DecodedCache:
    """`read()` gives the cached images when the listing matches and the pixels check out, else None (then the
    caller decodes and `write`s); a damaged or stale file is simply rebuilt."""

    def __init__(self, path: Path, listing: str) -> None:
        self.path = path
        self.listing = listing

    def read(self) -> np.ndarray | None:
        try:
            with np.load(self.path, allow_pickle=False) as archive:
                if str(archive["listing"]) != self.listing:
                    return None
                x = archive["x"]
                if x.dtype != np.uint8 or x.ndim != 4 or str(archive["sha256"]) != _pixels_digest(x):
                    return None
                return x
        except (OSError, ValueError, KeyError):
            return None

    def write(self, x: np.ndarray) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as handle:
            np.savez(handle, x=x, listing=np.str_(self.listing), sha256=np.str_(_pixels_digest(x)))
        os.replace(partial, self.path)
