"""A PNG sample grid with one row per class, drawn through the same sampler the service uses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from generator_service.ddpm.sampling import DdimSampler, ImageKey

MIN_CELL_PIXELS = 32  # 8x8 digits are scaled up so the grid is readable
GAP_VALUE = 128


def sample_per_class(sampler: DdimSampler, *, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """per_class images of every class (uint8 N x H x W x C) and their labels, in class order."""
    keys = [ImageKey(seed, c, i) for c in range(sampler.num_classes) for i in range(per_class)]
    size = sampler.config.batch_size
    images = np.concatenate([sampler.sample(keys[i : i + size]) for i in range(0, len(keys), size)])
    return images, np.array([k.class_id for k in keys], dtype=np.int64)


def save_class_grid(sampler: DdimSampler, path: Path, *, per_class: int, seed: int) -> Path:
    images, _ = sample_per_class(sampler, per_class=per_class, seed=seed)
    return save_image_grid(images, path, num_classes=sampler.num_classes, per_class=per_class)


def save_image_grid(images: np.ndarray, path: Path, *, num_classes: int, per_class: int) -> Path:
    """Write uint8 N x H x W x C images, per_class of each class in class order, as a grid with a row per class."""
    images = np.pad(images, ((0, 0), (0, 1), (0, 1), (0, 0)), constant_values=GAP_VALUE)  # a line between cells
    _, h, w, c = images.shape
    rows = images.reshape(num_classes, per_class, h, w, c)
    grid = rows.transpose(0, 2, 1, 3, 4).reshape(num_classes * h, per_class * w, c)
    picture = Image.fromarray(grid[..., 0] if c == 1 else grid)
    scale = max(1, MIN_CELL_PIXELS // (h - 1))
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.Resampling.NEAREST)
    picture.save(path)
    return path
