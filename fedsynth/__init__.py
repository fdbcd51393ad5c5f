"""fedsynth: the shared library that every fedsynth process (coordinator, client node, generator) imports."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__version__ = "0.2.0"


def load_model(path: str | os.PathLike[str]) -> nn.Module:
    """The model `fedsynth export` wrote to `path` (a safetensors file, its .json sidecar beside it) as a
    torch.nn.Module in eval mode, on the CPU: built from the sidecar's train.model, classes, image size and channels,
    the weights loaded strictly once their SHA-256 matches the sidecar's. Imported on first use, so that
    `import fedsynth` stays light (docs/guides/model-back.md)."""
    from fedsynth.learning.model_file import load_model as load

    return load(path)
