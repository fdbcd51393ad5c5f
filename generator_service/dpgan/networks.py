"""Unconditional DCGAN-style generator and a BatchNorm-free critic for 8x8 to 32x32 images, plus uint8 conversion."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedsynth.errors import DataError

IMAGE_SIDES = (8, 16, 32)
CHANNELS = (1, 3)
# Both networks work on a 4x4 feature map at their narrow end.
BASE_SIDE = 4


def check_image_shape(image_shape: tuple[int, int, int]) -> None:
    """Raise DataError unless (C, H, W) is square with a side in 8/16/32 and 1 or 3 channels."""
    c, h, w = image_shape
    if h != w or h not in IMAGE_SIDES or c not in CHANNELS:
        raise DataError(
            f"DP-GAN images must be square with side in {IMAGE_SIDES} and channels in {CHANNELS}, "
            f"got (C, H, W) = {image_shape}"
        )


def _num_resolution_steps(side: int) -> int:
    return int(np.log2(side // BASE_SIDE))


class Generator(nn.Module):
    """z ~ N(0, I) of size latent_dim -> image in [-1, 1], shape (C, H, W)."""

    def __init__(self, image_shape: tuple[int, int, int], *, latent_dim: int, width: int) -> None:
        super().__init__()
        check_image_shape(image_shape)
        self.image_shape = image_shape
        self.latent_dim = latent_dim
        n_up = _num_resolution_steps(image_shape[1])
        channels = [width * 2 ** (n_up - i) for i in range(n_up + 1)]  # e.g. 32x32: 8w, 4w, 2w, w
        self.base_channels = channels[0]
        self.project = nn.Linear(latent_dim, channels[0] * BASE_SIDE * BASE_SIDE)
        blocks: list[nn.Module] = []
        for c_in, c_out in zip(channels[:-1], channels[1:]):
            # GroupNorm, not BatchNorm: it behaves the same in train and eval mode, so sampling
            # after training draws from exactly the distribution the critic was trained against.
            blocks += [
                nn.GroupNorm(_groups(c_in), c_in),
                nn.ReLU(),
                nn.ConvTranspose2d(c_in, c_out, kernel_size=4, stride=2, padding=1),
            ]
        self.blocks = nn.Sequential(*blocks)
        self.to_image = nn.Sequential(
            nn.GroupNorm(_groups(channels[-1]), channels[-1]),
            nn.ReLU(),
            nn.Conv2d(channels[-1], image_shape[0], kernel_size=3, padding=1),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.project(z).view(len(z), self.base_channels, BASE_SIDE, BASE_SIDE)
        return self.to_image(self.blocks(h))


class Critic(nn.Module):
    """Image in [-1, 1] -> one unbounded score. No BatchNorm: each sample's score depends on it alone,
    which per-sample gradients (and the per-sample gradient penalty) require."""

    def __init__(self, image_shape: tuple[int, int, int], *, width: int) -> None:
        super().__init__()
        check_image_shape(image_shape)
        n_down = _num_resolution_steps(image_shape[1])
        channels = [width * 2**i for i in range(n_down + 1)]  # e.g. 32x32: w, 2w, 4w, 8w
        layers: list[nn.Module] = [nn.Conv2d(image_shape[0], channels[0], kernel_size=3, padding=1), nn.LeakyReLU(0.2)]
        for c_in, c_out in zip(channels[:-1], channels[1:]):
            layers += [nn.Conv2d(c_in, c_out, kernel_size=4, stride=2, padding=1), nn.LeakyReLU(0.2)]
        self.features = nn.Sequential(*layers)
        self.score = nn.Linear(channels[-1] * BASE_SIDE * BASE_SIDE, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.features(x).flatten(1)).squeeze(1)


def _groups(channels: int) -> int:
    return next(g for g in (8, 4, 2, 1) if channels % g == 0)


def images_to_tensor(x_uint8: np.ndarray) -> torch.Tensor:
    """uint8 N x H x W x C -> float32 N x C x H x W in [-1, 1]."""
    if not isinstance(x_uint8, np.ndarray) or x_uint8.dtype != np.uint8 or x_uint8.ndim != 4:
        got = f"{x_uint8.dtype} {x_uint8.shape}" if isinstance(x_uint8, np.ndarray) else type(x_uint8).__name__
        raise DataError(f"DP-GAN training images must be uint8 N x H x W x C, got {got}")
    x = torch.from_numpy(np.ascontiguousarray(x_uint8)).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


def tensor_to_images(x: torch.Tensor) -> np.ndarray:
    """float N x C x H x W in [-1, 1] -> uint8 N x H x W x C (values outside [-1, 1] saturate)."""
    scaled = ((x.detach().float().cpu().clamp(-1.0, 1.0) + 1.0) * 127.5).round()
    return scaled.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
