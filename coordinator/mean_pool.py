"""FedMix / NaiveMix on the coordinator: validate each client's one mean-data upload, pool them, ship the pool.

A client uploads floor(N_k / M) means once (M = the algorithm's mean_batch, N_k what it registered). The pool
closes when round 1 starts: from then on it never changes, so each client is sent it once (the task payload's
"mean" group carries the images and labels only for a client that does not hold the pool's digest) and it is kept
in OUTDIR/mean-data.safetensors for a restarted coordinator. An upload that is refused changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from coordinator.shared_uploads import await_uploads
from fedsynth.wire import codec
from fedsynth.errors import StateError, WireError
from fedsynth.process.runtime import write_atomic

log = logging.getLogger(__name__)
FILE_NAME = "mean-data.safetensors"
LABEL_SUM_TOLERANCE = 1e-4
PIXEL_MAX = 255.0


class MeanDataPool:
    """Every method takes the pool's own lock. `num_samples(client_id)` gives the N_k a client registered (None if
    it is not registered)."""

    def __init__(self, *, image_shape_hwc: tuple[int, int, int], num_classes: int, mean_batch: int, run_id: str) -> None:
        self.image_shape = image_shape_hwc
        self.num_classes = num_classes
        self.mean_batch = mean_batch
        self.run_id = run_id
        self.uploads: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # client -> (images N x H x W x C, labels N x C)
        self.closed = False
        self._digest: str | None = None
        self._lock = threading.Condition()

    # ---- uploads ---------------------------------------------------------------------------------

    def check_header(self, client_id: int, num_samples: int, header: dict[str, Any]) -> None:
        """StateError for an upload that does not fit the run's state, WireError for one that contradicts itself."""
        if self.closed:
            raise StateError(f"client {client_id}: the mean-data pool closed when round 1 started; uploads come before it")
        if client_id in self.uploads:
            raise StateError(f"client {client_id} already uploaded its mean data (it is uploaded once)")
        shape = (header["height"], header["width"], header["channels"])
        if shape != self.image_shape:
            raise WireError(f"mean images must be {self.image_shape} (H, W, C), got {shape}")
        if header["num_classes"] != self.num_classes:
            raise WireError(f"mean labels must have {self.num_classes} classes, got num_classes={header['num_classes']}")
        if header["mean_batch"] != self.mean_batch:
            raise WireError(f"mean_batch={header['mean_batch']}, but this run averages {self.mean_batch} images per mean")
        expected = num_samples // self.mean_batch
        if header["count"] != expected:
            raise WireError(f"client {client_id} announced count={header['count']} means; N_k={num_samples} images in "
                            f"groups of {self.mean_batch} make {expected}")

    def max_bytes(self, count: int) -> int:
        """The safetensors size of `count` means, with room for its JSON header."""
        return count * 4 * (int(np.prod(self.image_shape)) + self.num_classes) + 4096

    def parse(self, header: dict[str, Any], data: bytes) -> tuple[np.ndarray, np.ndarray]:
        """The upload's (images, labels) after every check on values; WireError naming the first one that fails."""
        tensors = codec.decode(data)
        if set(tensors) != {"images", "labels"}:
            raise WireError(f"a mean-data upload holds exactly 'images' and 'labels', got {sorted(tensors)[:5]}")
        images, labels = tensors["images"], tensors["labels"]
        count = header["count"]
        for name, value, shape in (("images", images, (count, *self.image_shape)), ("labels", labels, (count, self.num_classes))):
            if value.dtype != torch.float32:
                raise WireError(f"mean {name} must be float32, got {value.dtype}")
            if tuple(value.shape) != shape:
                raise WireError(f"mean {name} must have shape {shape}, got {tuple(value.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise WireError(f"mean {name} hold NaN or infinite values")
        if count and not (float(images.min()) >= 0.0 and float(images.max()) <= PIXEL_MAX):
            raise WireError(f"mean images must lie in [0, {PIXEL_MAX:.0f}], got values in "
                            f"[{float(images.min())}, {float(images.max())}]")
        if count and float(labels.min()) < 0.0:
            raise WireError(f"mean labels must be non-negative, got {float(labels.min())}")
        sums = labels.double().sum(dim=1)
        bad = torch.nonzero((sums - 1.0).abs() > LABEL_SUM_TOLERANCE)
        if len(bad):
            row = int(bad[0])
            raise WireError(f"mean label row {row} sums to {float(sums[row])}, not 1")
        return images.numpy().copy(), labels.numpy().copy()

    def accept(self, client_id: int, num_samples: int, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> int:
        with self._lock:
            self.check_header(client_id, num_samples, header)
        meta = codec.PayloadMeta(header["total_bytes"], header["sha256"], header["num_chunks"], header.get("xxh3_128", b""))
        data = codec.assemble(meta, chunks, max_bytes=self.max_bytes(header["count"]))
        images, labels = self.parse(header, data)
        with self._lock:
            self.check_header(client_id, num_samples, header)  # a concurrent duplicate, or round 1, came first
            self.uploads[client_id] = (images, labels)
            self._digest = None
            self._lock.notify_all()
        log.info("client %d uploaded %d means of %d images", client_id, len(images), self.mean_batch)
        return len(images)

    def wanted(self, client_id: int) -> bool:
        with self._lock:
            return not self.closed and client_id not in self.uploads

    def await_uploads(self, registered: list[int], *, timeout_s: float, need: int) -> None:
        """Wait (bounded) for every registered client's upload, then close the pool for the rest of the run."""
        with self._lock:
            if self.closed:
                return
            await_uploads(self._lock, lambda: self.uploads, registered, timeout_s=timeout_s, need=need, what="mean data")
            self.closed = True
        log.info("mean-data pool closed: %d means from %d clients", sum(len(y) for _, y in self.uploads.values()), len(self.uploads))

    # ---- the pool --------------------------------------------------------------------------------

    def _pooled(self) -> tuple[np.ndarray, np.ndarray]:
        clients = sorted(self.uploads)
        if not clients:
            return np.zeros((0, *self.image_shape), np.float32), np.zeros((0, self.num_classes), np.float32)
        return (np.concatenate([self.uploads[c][0] for c in clients]), np.concatenate([self.uploads[c][1] for c in clients]))

    def digest(self) -> str:
        """Identity of the closed pool; "" while it is open (then no client holds it)."""
        with self._lock:
            if not self.closed:
                return ""
            if self._digest is None:
                h = hashlib.sha256()
                for c in sorted(self.uploads):
                    h.update(c.to_bytes(4, "little"))
                    for array in self.uploads[c]:
                        h.update(array.tobytes())
                self._digest = h.hexdigest()
            return self._digest

    def task_group(self, *, with_data: bool) -> dict[str, torch.Tensor]:
        """The task payload's "mean" group: the pool's digest, and the images and labels when `with_data`."""
        out = {"digest": torch.frombuffer(bytearray(bytes.fromhex(self.digest())), dtype=torch.uint8)}
        if with_data:
            with self._lock:
                images, labels = self._pooled()
            out["images"], out["labels"] = torch.from_numpy(images), torch.from_numpy(labels)
        return out

    def total(self) -> int:
        with self._lock:
            return sum(len(y) for _, y in self.uploads.values())

    # ---- kept for a restarted coordinator --------------------------------------------------------

    def save(self, out_dir: Path) -> None:
        with self._lock:
            tensors: dict[str, torch.Tensor] = {}
            for c, (images, labels) in self.uploads.items():
                tensors[f"images_{c}"], tensors[f"labels_{c}"] = torch.from_numpy(images), torch.from_numpy(labels)
        meta = {"run_id": self.run_id, "clients": json.dumps(sorted(tensors))}
        write_atomic(out_dir / FILE_NAME, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    def load(self, out_dir: Path) -> bool:
        """Restore a closed pool this run saved; False when there is none."""
        path = out_dir / FILE_NAME
        if not path.is_file():
            return False
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("run_id") != self.run_id:
            raise StateError(f"{path} belongs to run {meta.get('run_id')!r}, not {self.run_id!r}")
        tensors = load_file(str(path))
        with self._lock:
            for key, value in tensors.items():
                if key.startswith("images_"):
                    c = int(key.removeprefix("images_"))
                    self.uploads[c] = (value.numpy(), tensors[f"labels_{c}"].numpy())
            self.closed = True
            self._digest = None
        return True
