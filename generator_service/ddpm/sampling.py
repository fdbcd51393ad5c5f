"""Deterministic DDIM sampling with classifier-free guidance; each image is a pure function of its key.

A key names either a fresh image (ImageKey) or a variation of a given one (VariationKey: SDEdit, as diffusers'
image-to-image pipelines do it: the source is noised to the timestep its strength picks, then denoised by the same
guided DDIM loop over the rest of the schedule)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class VariationKey(ImageKey):
    """Names one variation: (seed, class, index) as an ImageKey, plus its source (uint8 H x W x C bytes of the served
    shape) and strength in (0, 1]. It IS an ImageKey, so the batcher and every backend signature carry both kinds; a
    backend serves variations only if it says so (generator_service.backends.check_variations), since one that does not
    look would take it for a fresh image."""

    source: bytes = field(repr=False)
    strength: float


# An extra SeedSequence word for variations: a variation's noise is never that of the Generate image with the same
# (seed, class, index), which at strength 1 would otherwise redraw (nearly) that very image.
VARIATION_TAG = 0x7A12
# Strength travels as a float32 (0.7 arrives as 0.69999998): floor(steps * strength) tolerates that much.
STRENGTH_TOLERANCE = 1e-4


def noise_seed(key: ImageKey) -> int:
    """A 63-bit seed derived from (seed, class, index) alone (and, for a variation, a tag), so the noise never depends
    on batching, nor, for a variation, on its source or strength."""
    words = [key.seed, key.class_id, key.index] + ([VARIATION_TAG] if isinstance(key, VariationKey) else [])
    state = np.random.SeedSequence(words).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def steps_rerun(strength: float, steps: int) -> int:
    """How many of `steps` sampling steps a variation re-runs: diffusers' img2img rule min(int(steps * strength),
    steps), with a float32 tolerance, and at least 1."""
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    return max(1, min(math.floor(steps * strength + STRENGTH_TOLERANCE), steps))


def group_rows(keys: Sequence[ImageKey], steps: int) -> list[tuple[list[int], int | None]]:
    """Rows of `keys` that can share one sampling batch, in order of first appearance: the fresh images (None), and
    the variations by the number of steps they re-run (their strength matters only through it)."""
    groups: dict[int | None, list[int]] = {}
    for row, key in enumerate(keys):
        rerun = steps_rerun(key.strength, steps) if isinstance(key, VariationKey) else None
        groups.setdefault(rerun, []).append(row)
    return [(rows, rerun) for rerun, rows in groups.items()]


def source_pixels(key: VariationKey, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """A variation's source as floats C x H x W in [0, 1]."""
    channels, height, width = image_shape
    if len(key.source) != channels * height * width:
        raise ValueError(f"a variation source of {len(key.source)} bytes is not one {height}x{width}x{channels} image")
    pixels = np.frombuffer(key.source, dtype=np.uint8).reshape(height, width, channels)
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0


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
        """uint8 images N x H x W x C for up to batch_size keys, fresh images and variations mixed, identical whatever
        else shares the batch: each group of rows (group_rows) runs on a batch of its own, padded to batch_size."""
        count, size = len(keys), self.config.batch_size
        if not 1 <= count <= size:
            raise ValueError(f"sample() takes 1..{size} keys, got {count}")
        for key in keys:
            if not 0 <= key.class_id < self.num_classes:
                raise ValueError(f"class id {key.class_id} out of range 0..{self.num_classes - 1}")
        channels, height, width = self.image_shape
        images = np.empty((count, height, width, channels), dtype=np.uint8)
        for rows, rerun in group_rows(keys, self.config.steps):
            images[rows] = self._sample_group([keys[row] for row in rows], rerun)
        return images

    def _sample_group(self, keys: Sequence[ImageKey], rerun: int | None) -> np.ndarray:
        """Fresh images (rerun None) from pure noise over every timestep; variations (SDEdit) from their sources
        noised to the first of the last `rerun` timesteps, with that same per-key CPU noise, then denoised over them."""
        size = self.config.batch_size
        noise = torch.zeros((size, *self.image_shape))
        labels = torch.full((size,), self.num_classes, dtype=torch.long)
        for row, key in enumerate(keys):
            noise[row] = initial_noise(key, self.image_shape)
            labels[row] = key.class_id
        timesteps = self.scheduler.timesteps
        if rerun is None:
            x = noise
        else:
            timesteps = timesteps[len(timesteps) - rerun :]
            sources = torch.zeros((size, *self.image_shape))  # padding rows: a zero (mid-gray) source
            for row, key in enumerate(keys):
                assert isinstance(key, VariationKey)
                sources[row] = source_pixels(key, self.image_shape) * 2.0 - 1.0
            start = torch.full((size,), int(timesteps[0]), dtype=torch.long)
            x = self.scheduler.add_noise(sources, noise, start)  # on the CPU: the same numbers on every device
        x, labels = x.to(self.device), labels.to(self.device)
        for timestep in timesteps:
            t = torch.full((size,), int(timestep), device=self.device, dtype=torch.long)
            t_model = t if self.config.guidance == 0.0 else torch.cat([t, t])
            eps = self._epsilon(x, t_model, labels)
            x = self.scheduler.step(eps, int(timestep), x, eta=0.0).prev_sample
        return to_uint8_nhwc(x[: len(keys)])
