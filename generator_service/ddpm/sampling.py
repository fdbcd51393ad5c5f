"""Deterministic DDIM sampling with classifier-free guidance; each image is a pure function of its key."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import DDIMScheduler, UNet2DModel

from fedsynth.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ImageKey:
    """Names one image: the request seed, its class and its index within the class."""

    seed: int
    class_id: int
    index: int


def noise_seed(key: ImageKey) -> int:
    """A 63-bit seed derived from (seed, class, index) alone, so the noise never depends on batching."""
    state = np.random.SeedSequence([key.seed, key.class_id, key.index]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def initial_noise(key: ImageKey, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """The starting noise of one image, drawn on the CPU so every device starts from the same numbers."""
    generator = torch.Generator(device="cpu").manual_seed(noise_seed(key))
    return torch.randn(image_shape, generator=generator, dtype=torch.float32)


def to_uint8_nhwc(images: torch.Tensor) -> np.ndarray:
    """[-1, 1] floats N x C x H x W -> uint8 N x H x W x C."""
    scaled = ((images.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return scaled.permute(0, 2, 3, 1).contiguous().cpu().numpy()


@dataclass(frozen=True)
class SamplingConfig:
    """DDIM steps, guidance weight w (eps = (1 + w) eps_cond - w eps_null; 0 = no guidance) and the fixed batch."""

    steps: int
    guidance: float
    batch_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 1000:
            raise ConfigError(f"ddim steps must be in 1..1000, got {self.steps}")
        if not 0.0 <= self.guidance <= 100.0:
            raise ConfigError(f"guidance must be in 0..100, got {self.guidance}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; expected auto, cpu or cuda")
    return torch.device(name)


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 autocast on a GPU that supports it (fp16 can overflow in attention); fp32 otherwise."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


class DdimSampler:
    """Runs the UNet on a FIXED batch size (padding unused rows), because CPU kernels give slightly different
    floats for different batch sizes, while a row's result does not depend on its position or neighbours."""

    def __init__(
        self,
        unet: UNet2DModel,
        scheduler_config: dict[str, Any],
        *,
        num_classes: int,
        image_shape: tuple[int, int, int],
        config: SamplingConfig,
        device: torch.device,
    ) -> None:
        self.unet = unet.to(device).eval()
        self.num_classes = num_classes
        self.image_shape = image_shape
        self.config = config
        self.device = device
        self.dtype = compute_dtype(device)
        # Deterministic DDIM (eta = 0); "trailing" spacing starts at t = 999, which matters with few steps.
        self.scheduler = DDIMScheduler.from_config(
            scheduler_config, timestep_spacing="trailing", clip_sample=True, set_alpha_to_one=True
        )
        self.scheduler.set_timesteps(config.steps)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _epsilon(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        w = self.config.guidance
        with self._autocast():
            if w == 0.0:
                return self.unet(x, t, class_labels=labels).sample.float()
            null = torch.full_like(labels, self.num_classes)
            both = self.unet(torch.cat([x, x]), t, class_labels=torch.cat([labels, null])).sample.float()
        cond, uncond = both.chunk(2)
        return (1.0 + w) * cond - w * uncond

    @torch.no_grad()
    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        """uint8 images N x H x W x C for up to batch_size keys, identical whatever else shares the batch."""
        count, size = len(keys), self.config.batch_size
        if not 1 <= count <= size:
            raise ValueError(f"sample() takes 1..{size} keys, got {count}")
        noise = torch.zeros((size, *self.image_shape))
        labels = torch.full((size,), self.num_classes, dtype=torch.long)
        for row, key in enumerate(keys):
            if not 0 <= key.class_id < self.num_classes:
                raise ValueError(f"class id {key.class_id} out of range 0..{self.num_classes - 1}")
            noise[row] = initial_noise(key, self.image_shape)
            labels[row] = key.class_id
        x, labels = noise.to(self.device), labels.to(self.device)
        for timestep in self.scheduler.timesteps:
            t = torch.full((size,), int(timestep), device=self.device, dtype=torch.long)
            t_model = t if self.config.guidance == 0.0 else torch.cat([t, t])
            eps = self._epsilon(x, t_model, labels)
            x = self.scheduler.step(eps, int(timestep), x, eta=0.0).prev_sample
        return to_uint8_nhwc(x[:count])
