"""The one rule for images and labels read from an .npz file: x uint8 N x H x W (x C) and y N integer labels."""

from __future__ import annotations

import numpy as np

from fedsynth.errors import DataError, FedsynthError


def checked_image_arrays(x: np.ndarray, y: np.ndarray, where: str,
                         error: type[FedsynthError] = DataError) -> tuple[np.ndarray, np.ndarray]:
    """(x as N x H x W x C, y) when they follow the rule; else `error` naming `where` (the file) and what was found."""
    if x.ndim == 3:
        x = x[..., None]
    if x.dtype != np.uint8 or x.ndim != 4 or y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise error(f"{where}: x must be uint8 N x H x W x C and y N integer labels, "
                    f"found x {x.dtype} {x.shape}, y {y.dtype} {y.shape}")
    return x, y
