"""SDA-FL's server side: the shared synthetic set, per-round pseudo-labels, and fine-tuning the global model on it."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.errors import StateError, WireError
from fedsynth.learning.hardware import to_device
from fedsynth.learning.training import images_to_tensor

log = logging.getLogger(__name__)
UNLABELLED = -1


@dataclass(frozen=True)
class Upload:
    images: np.ndarray  # uint8 N x H x W x C
    privacy: dict[str, float]  # epsilon, delta, noise_multiplier, gan_seconds


class SyntheticPool:
    def __init__(self, *, image_shape: tuple[int, int, int], num_classes: int, max_per_client: int, tau: float) -> None:
        self.image_shape = image_shape  # (H, W, C)
        self.num_classes = num_classes
        self.max_per_client = max_per_client
        self.tau = tau
        self.uploads: dict[int, Upload] = {}
        self.labels: dict[int, np.ndarray] = {}
        self._digest: str | None = None

    # ---- uploads ---------------------------------------------------------------------------------

    def check_header(self, client_id: int, count: int, shape: tuple[int, int, int], dtype: str) -> None:
        if client_id in self.uploads:
            raise StateError(f"client {client_id} already uploaded its synthetic samples (they are uploaded once)")
        if dtype != "uint8":
            raise WireError(f"synthetic images must be uint8, got dtype {dtype!r}")
        if shape != self.image_shape:
            raise WireError(f"synthetic images must be {self.image_shape} (H, W, C), got {shape}")
        if not 1 <= count <= self.max_per_client:
            raise WireError(f"synthetic upload of {count} images; expected 1..{self.max_per_client}")

    def add(self, client_id: int, images: np.ndarray, privacy: dict[str, float]) -> None:
        self.uploads[client_id] = Upload(images, privacy)
        self.labels[client_id] = np.full(len(images), UNLABELLED, dtype=np.int64)
        self._digest = None

    @property
    def clients(self) -> list[int]:
        return sorted(self.uploads)

    def images(self) -> np.ndarray:
        return np.concatenate([self.uploads[c].images for c in self.clients])

    def all_labels(self) -> np.ndarray:
        return np.concatenate([self.labels[c] for c in self.clients])

    def digest(self) -> str:
        """Identity of the image set in client order: a client holding this digest needs no images again."""
        if self._digest is None:
            h = hashlib.sha256()
            for c in self.clients:
                h.update(c.to_bytes(4, "little"))
                h.update(self.uploads[c].images.tobytes())
            self._digest = h.hexdigest()
        return self._digest

    # ---- pseudo-labels -----------------------------------------------------------------------------

    def pseudo_label(self, client_id: int, model: nn.Module) -> np.ndarray:
        """Labels of this client's samples from its new local model (on the model's device): argmax where max probability
        > tau, else -1."""
        upload = self.uploads.get(client_id)
        if upload is None:
            return np.zeros(0, dtype=np.int64)
        device = next(model.parameters()).device
        model.eval()
        with torch.inference_mode():
            probs = F.softmax(model(to_device(images_to_tensor(upload.images), device)).float(), dim=1).cpu()
        confidence, label = probs.max(dim=1)
        return torch.where(confidence > self.tau, label, torch.full_like(label, UNLABELLED)).numpy().astype(np.int64)

    def set_labels(self, client_id: int, labels: np.ndarray) -> None:
        if client_id in self.labels:
            self.labels[client_id] = labels

    def coverage(self) -> float:
        labels = self.all_labels() if self.uploads else np.zeros(0)
        return float((labels != UNLABELLED).mean()) if len(labels) else 0.0

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.uploads:
            return np.zeros((0, *self.image_shape), np.uint8), np.zeros(0, np.int64)
        labels = self.all_labels()
        keep = labels != UNLABELLED
        return self.images()[keep], labels[keep]

    # ---- checkpoint ----------------------------------------------------------------------------------

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for c in self.clients:
            out[f"images_{c}"] = torch.from_numpy(self.uploads[c].images)
            out[f"labels_{c}"] = torch.from_numpy(self.labels[c])
        return out

    def privacy_record(self) -> dict[str, dict[str, float]]:
        return {str(c): dict(self.uploads[c].privacy, samples=len(self.uploads[c].images)) for c in self.clients}

    def restore(self, tensors: dict[str, torch.Tensor], privacy: dict[str, dict[str, Any]]) -> None:
        for key, value in tensors.items():
            if key.startswith("images_"):
                c = int(key.removeprefix("images_"))
                record = {k: float(v) for k, v in privacy.get(str(c), {}).items() if k != "samples"}
                self.add(c, value.numpy(), record)
        for key, value in tensors.items():
            if key.startswith("labels_"):
                self.labels[int(key.removeprefix("labels_"))] = value.numpy()


def mixup_finetune(
    model: nn.Module, images: np.ndarray, labels: np.ndarray, *, steps: int, lr: float, batch_size: int, alpha: float, seed: int
) -> float:
    """The server's step after aggregation: SGD on mixup of two labelled synthetic batches, on the model's device (the
    draws are the CPU's wherever it runs); returns the mean loss."""
    if steps == 0 or len(labels) == 0:
        return float("nan")
    generator = torch.Generator().manual_seed(seed)
    mix_rng = np.random.default_rng(seed)
    x, y = images_to_tensor(images), torch.as_tensor(labels)
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    losses = []
    for _ in range(steps):
        first = torch.randint(len(y), (min(batch_size, len(y)),), generator=generator)
        second = torch.randint(len(y), (len(first),), generator=generator)
        lam = float(mix_rng.beta(alpha, alpha))
        x_first, x_second = to_device(x[first], device), to_device(x[second], device)
        y_first, y_second = to_device(y[first], device), to_device(y[second], device)
        logits = model(lam * x_first + (1 - lam) * x_second)
        loss = lam * F.cross_entropy(logits, y_first) + (1 - lam) * F.cross_entropy(logits, y_second)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    model.eval()
    return float(np.mean(losses))
