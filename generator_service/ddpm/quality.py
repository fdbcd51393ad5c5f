"""Do generated images look like their class? A pixel classifier trained on real data labels them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from fedsynth.learning.data import load_dataset
from generator_service.ddpm.grid import sample_per_class
from generator_service.ddpm.model import load_generator
from generator_service.ddpm.sampling import DdimSampler, SamplingConfig, resolve_device


@dataclass(frozen=True)
class QualityReport:
    real_test_accuracy: float  # the classifier on the real test split: the ceiling to compare against
    generated_accuracy: float
    per_class_accuracy: tuple[float, ...]


def _features(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).astype(np.float64) / 255.0


def classifier_check(folder: Path, *, per_class: int = 100, seed: int = 0, ddim_steps: int | None = None,
                     guidance: float | None = None, data_dir: Path | None = None) -> QualityReport:
    """Train logistic regression on the real training split, then label per_class generated images per class."""
    loaded = load_generator(folder)
    meta = loaded.metadata
    train = load_dataset(meta.dataset, "train", data_dir=data_dir)
    test = load_dataset(meta.dataset, "test", data_dir=data_dir)
    classifier = LogisticRegression(max_iter=2000).fit(_features(train.x), train.y)
    config = SamplingConfig(ddim_steps or meta.ddim_steps, meta.guidance if guidance is None else guidance, 64)
    sampler = DdimSampler(loaded.unet, loaded.scheduler_config, num_classes=meta.num_classes,
                          image_shape=meta.image_shape, config=config, device=resolve_device("auto"))
    with torch.inference_mode():
        images, labels = sample_per_class(sampler, per_class=per_class, seed=seed)
    predicted = classifier.predict(_features(images))
    per_class_accuracy = tuple(float(np.mean(predicted[labels == c] == c)) for c in range(meta.num_classes))
    return QualityReport(
        real_test_accuracy=float(classifier.score(_features(test.x), test.y)),
        generated_accuracy=float(np.mean(predicted == labels)),
        per_class_accuracy=per_class_accuracy,
    )
