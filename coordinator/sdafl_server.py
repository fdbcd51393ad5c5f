"""SDA-FL's coordinator hooks: collect uploads, attach the labelled synthetic set to tasks, pseudo-label, fine-tune."""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator.shared_uploads import await_uploads
from coordinator.synthetic_pool import UNLABELLED, SyntheticPool, mixup_finetune
from fedsynth.wire import codec
from fedsynth.config import RunConfig
from fedsynth.learning.data import ArrayDataset, load_dataset
from fedsynth.learning.hardware import resolve_hardware
from fedsynth.errors import StateError, WireError

log = logging.getLogger(__name__)
REFERENCE_MAX_SAMPLES = 10_000
MAX_REASON_CHARS = 500  # of a client's failure report, kept for the log
REFERENCE_TIMEOUT_S = 3600.0  # logistic regression on 10,000 CIFAR images: minutes on a crowded CPU, bounded by max_iter


class ReferenceClassifier:
    """A centrally trained logistic regression on the real training split. It stands in for the 'true class'
    of unlabelled GAN samples when the harness reports pseudo-label agreement; it is never used for training.
    It trains on a thread of its own: on CIFAR-10 that takes minutes on a CPU, which must not delay the server."""

    def __init__(self, train: ArrayDataset, seed: int) -> None:
        from sklearn.linear_model import LogisticRegression

        rng = np.random.default_rng(seed)
        keep = rng.permutation(len(train.y))[:REFERENCE_MAX_SAMPLES]
        self.model = LogisticRegression(max_iter=300)
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, args=(self._features(train.x[keep]), train.y[keep]),
                                        name="sdafl-reference", daemon=True)
        self._thread.start()

    def _fit(self, x: np.ndarray, y: np.ndarray) -> None:
        try:
            self.model.fit(x, y)
        except BaseException as exc:  # raised to the caller of predict
            self._failure = exc

    @staticmethod
    def _features(x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), -1).astype(np.float32) / 255.0

    def predict(self, x: np.ndarray) -> np.ndarray:
        self._thread.join(timeout=REFERENCE_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the SDA-FL reference classifier did not finish training within {REFERENCE_TIMEOUT_S:.0f}s")
        if self._failure is not None:
            raise RuntimeError(f"the SDA-FL reference classifier failed to train: {self._failure}") from self._failure
        return self.model.predict(self._features(x))


class SdaflServer:
    def __init__(self, cfg: RunConfig, image_shape_chw: tuple[int, int, int], num_classes: int) -> None:
        c, h, w = image_shape_chw
        self.cfg = cfg
        self.pool = SyntheticPool(image_shape=(h, w, c), num_classes=num_classes, max_per_client=cfg.sdafl.samples_per_client, tau=cfg.sdafl.tau)
        self.reference: ReferenceClassifier | None = None
        if cfg.sdafl.track_agreement and cfg.data.source == "split":  # local mode: the coordinator holds no data
            train = load_dataset(cfg.data.dataset, "train", data_dir=cfg.data.data_dir, download=cfg.data.download)
            self.reference = ReferenceClassifier(train, cfg.seed)
        self._lock = threading.Condition()
        self.failed: dict[int, str] = {}  # client id -> why its DP-GAN failed (it will not upload)
        # train.device: pseudo-labelling and the server's fine-tuning run there (the global model stays on the CPU; a
        # replica on a GPU is loaded with it for each fine-tune and copied back)
        self.device = resolve_hardware(cfg.train.device, cfg.train.precision)
        self._replica: nn.Module | None = None

    # ---- uploads ---------------------------------------------------------------------------------

    def accept_upload(self, client_id: int, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> int:
        for key in ("epsilon", "delta", "noise_multiplier", "gan_seconds"):  # reported as they come: finite, >= 0
            if not (math.isfinite(header[key]) and header[key] >= 0):
                raise WireError(f"synthetic upload: {key} must be a finite number >= 0, got {header[key]!r}")
        shape = (header["height"], header["width"], header["channels"])
        with self._lock:
            self.pool.check_header(client_id, header["count"], shape, header["dtype"])
        expected = header["count"] * int(np.prod(shape))
        if header["total_bytes"] != expected:
            raise WireError(f"synthetic upload announces {header['total_bytes']} bytes; {header['count']} images of {shape} are {expected}")
        meta = codec.PayloadMeta(header["total_bytes"], header["sha256"], header["num_chunks"], header.get("xxh3_128", b""))
        data = codec.assemble(meta, chunks, max_bytes=expected)
        images = np.frombuffer(data, dtype=np.uint8).reshape(header["count"], *shape).copy()
        privacy = {k: float(header[k]) for k in ("epsilon", "delta", "noise_multiplier", "gan_seconds")}
        with self._lock:
            self.pool.check_header(client_id, header["count"], shape, header["dtype"])  # a concurrent duplicate lost the race
            self.pool.add(client_id, images, privacy)
            self.failed.pop(client_id, None)  # it failed before, was restarted and made it
            self._lock.notify_all()
        log.info("client %d uploaded %d synthetic samples (epsilon %.2f, delta %.1e)", client_id, len(images), privacy["epsilon"], privacy["delta"])
        return len(images)

    def uploaded(self, client_id: int) -> bool:
        with self._lock:
            return client_id in self.pool.uploads

    def fail(self, client_id: int, reason: str) -> None:
        """The client's DP-GAN failed (its own report): the upload wait no longer waits for it."""
        reason = " ".join(reason.split())[:MAX_REASON_CHARS] or "no reason given"
        with self._lock:
            if client_id in self.pool.uploads:
                raise StateError(f"client {client_id} already uploaded its synthetic samples")
            self.failed[client_id] = reason
            self._lock.notify_all()
        log.warning("client %d will upload no synthetic samples: %s", client_id, reason)

    def await_uploads(self, registered: list[int], *, timeout_s: float, need: int) -> None:
        """Until every registered client uploaded or reported its DP-GAN failed (at most timeout_s); QuorumError,
        naming the failures, when fewer than `need` uploaded."""
        with self._lock:
            await_uploads(self._lock, lambda: self.pool.uploads, registered, timeout_s=timeout_s, need=need,
                          what="synthetic samples", failed=lambda: self.failed)

    # ---- per round -------------------------------------------------------------------------------

    def task_groups(self, *, with_images: bool) -> dict[str, torch.Tensor]:
        """The labelled synthetic set for a task: labels every round, images only for clients that lack them."""
        with self._lock:
            out = {"labels": torch.from_numpy(self.pool.all_labels()), "digest": torch.frombuffer(bytearray(bytes.fromhex(self.pool.digest())), dtype=torch.uint8)}
            if with_images:
                out["images"] = torch.from_numpy(self.pool.images())
        return out

    def digest(self) -> str:
        with self._lock:
            return self.pool.digest()

    def pseudo_labels(self, client_id: int, model: nn.Module) -> np.ndarray:
        """`model` is the caller's own copy of the client's model: it is moved to train.device."""
        return self.pool.pseudo_label(client_id, model.to(self.device))

    def commit_labels(self, client_id: int, labels: np.ndarray) -> None:
        with self._lock:
            self.pool.set_labels(client_id, labels)

    def after_aggregation(self, model: nn.Module, round_number: int) -> dict[str, Any]:
        """Fine-tune the new global model on the labelled synthetic set; report coverage and agreement."""
        s = self.cfg.sdafl
        with self._lock:
            images, labels = self.pool.labelled()
            coverage = self.pool.coverage()
        started = time.monotonic()
        tuned = model
        if self.device.type != "cpu" and s.server_steps and len(labels):
            if self._replica is None:
                self._replica = copy.deepcopy(model).to(self.device)
            tuned = self._replica
            tuned.load_state_dict(model.state_dict())
        loss = mixup_finetune(
            tuned, images, labels, steps=s.server_steps, lr=s.server_lr, batch_size=s.server_batch_size,
            alpha=s.mixup_alpha, seed=self.cfg.seed * 100_003 + round_number,
        )
        if tuned is not model:  # back into the CPU global model, BatchNorm's statistics included
            model.load_state_dict(tuned.state_dict())
            model.eval()
        agreement = None
        if self.reference is not None and len(labels):
            agreement = float((self.reference.predict(images) == labels).mean())
        return {
            "pseudo_label_coverage": coverage,
            "pseudo_labelled": int(len(labels)),
            "pseudo_label_agreement": agreement,
            "server_finetune_loss": loss if np.isfinite(loss) else None,
            "server_finetune_seconds": time.monotonic() - started,
        }

    # ---- checkpoint ------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with self._lock:
            return self.pool.to_tensors(), self.pool.privacy_record()

    def restore(self, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> None:
        with self._lock:
            self.pool.restore(tensors, record)

    def privacy_report(self) -> dict[str, Any]:
        with self._lock:
            return self.pool.privacy_record()


__all__ = ["SdaflServer", "UNLABELLED"]
