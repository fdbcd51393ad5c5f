"""The class-conditional UNet by size name, DDPM's noise schedule and its training loss, shared by the central
generator trainer (generator_service) and the federated one (clients train it as a run's model)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel

from fedsynth.config_schema import GENERATOR_SIDE_DIVISOR, GENERATOR_SIZES, require_names
from fedsynth.errors import ConfigError

NUM_TRAIN_TIMESTEPS = 1000
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # diffusers' name, in a generator folder


@dataclass(frozen=True)
class UNetSize:
    """One UNet layout: channels per level, residual blocks per level, and which levels have self-attention."""

    block_out_channels: tuple[int, ...]
    layers_per_block: int
    attention_levels: tuple[int, ...]
    norm_num_groups: int
    dropout: float


# "tiny" has two levels (8x8 -> 4x4 for digits, attention at 4x4) so 8x8 images need no padding; it has
# ~0.7M parameters and trains on digits on a CPU in minutes. "ddpm-cifar" is Ho et al.'s CIFAR-10 layout
# (ch 128, mult 1-2-2-2, 2 res blocks, attention at 16x16, dropout 0.1): 35.7M parameters. "half" is that
# layout at half width (~9M). Their three down-samplings need a side divisible by 8 (32 -> 4). "small" is the
# CPU recipe for 32x32 data: a third level (8x8, 128 channels) with the attention moved there, so a training step
# costs what tiny's does (attention over 64 positions instead of 256) for 4x the parameters and a receptive field
# that spans the image; ~2.7M parameters (docs/generator.md, "A CPU recipe for CIFAR-10").
SIZES: dict[str, UNetSize] = {
    "tiny": UNetSize((32, 64), 1, (1,), 8, 0.0),
    "small": UNetSize((32, 64, 128), 1, (2,), 8, 0.0),
    "half": UNetSize((64, 128, 128, 128), 2, (1,), 32, 0.1),
    "ddpm-cifar": UNetSize((128, 256, 256, 256), 2, (1,), 32, 0.1),
}
require_names("fedsynth.learning.unet.SIZES", SIZES, GENERATOR_SIZES)  # the names the config check offers
if {name: 2 ** (len(layout.block_out_channels) - 1) for name, layout in SIZES.items()} != GENERATOR_SIDE_DIVISOR:
    raise RuntimeError("fedsynth.config_schema.GENERATOR_SIDE_DIVISOR disagrees with the UNet layouts")


def build_unet(size: str, *, num_classes: int, image_shape: tuple[int, int, int], seed: int | None = 0) -> UNet2DModel:
    """A freshly initialised UNet; class index num_classes is the null label used for classifier-free guidance.
    seed None leaves torch's global RNG as it is (the coordinator seeds it before building a run's model)."""
    if size not in SIZES:
        raise ConfigError(f"unknown generator size {size!r}; expected one of {', '.join(SIZES)}")
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
    layout = SIZES[size]
    channels, height, width = image_shape
    factor = 2 ** (len(layout.block_out_channels) - 1)
    if height != width or height % factor:
        raise ConfigError(f"size {size!r} needs square images with a side divisible by {factor}, got {height}x{width}")
    levels = range(len(layout.block_out_channels))
    down = tuple("AttnDownBlock2D" if i in layout.attention_levels else "DownBlock2D" for i in levels)
    up = tuple("AttnUpBlock2D" if i in layout.attention_levels else "UpBlock2D" for i in reversed(levels))
    if seed is not None:
        torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=height,
        in_channels=channels,
        out_channels=channels,
        block_out_channels=layout.block_out_channels,
        layers_per_block=layout.layers_per_block,
        down_block_types=down,
        up_block_types=up,
        norm_num_groups=layout.norm_num_groups,
        dropout=layout.dropout,
        attention_head_dim=None,  # one head per attention layer, as in DDPM
        num_class_embeds=num_classes + 1,
    )


def make_train_scheduler() -> DDPMScheduler:
    """DDPM's linear beta schedule over 1000 steps, predicting the noise; samples are clipped to [-1, 1]."""
    return DDPMScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, beta_schedule="linear", prediction_type="epsilon")


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def noised_batch(scheduler: DDPMScheduler, x0: torch.Tensor, labels: torch.Tensor, *, num_classes: int, label_dropout: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy images, timesteps, labels with the null label at rate label_dropout, the noise to predict), all drawn
    from `generator` on the CPU: DDPM's training input for clean images x0 in [-1, 1]."""
    n = len(x0)
    labels = torch.where(torch.rand(n, generator=generator) < label_dropout, num_classes, labels.cpu())
    noise = torch.randn(x0.shape, generator=generator)
    t = torch.randint(scheduler.config.num_train_timesteps, (n,), generator=generator)
    device = x0.device
    noise, t, labels = noise.to(device), t.to(device), labels.to(device)
    return scheduler.add_noise(x0, noise, t), t, labels, noise


def denoising_loss(unet: torch.nn.Module, noisy: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, noise: torch.Tensor,
                   *, reduction: str = "mean") -> torch.Tensor:
    """DDPM's simple loss: the mean squared error of the predicted noise (per image with reduction="none")."""
    predicted = unet(noisy, t, class_labels=labels).sample.float()
    if reduction == "none":
        return (predicted - noise).pow(2).flatten(1).mean(1)
    return F.mse_loss(predicted, noise)


def load_initial_weights(unet: torch.nn.Module, folder: Path) -> None:
    """Load a generator folder's UNet weights (safetensors) into `unet`, which must have the same layout: the warm
    start of a federated generator. ConfigError naming federate.init when it does not fit."""
    from safetensors.torch import load_file

    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise ConfigError(f"federate.init={str(folder)!r} is not a generator folder: {WEIGHTS_FILE} is missing")
    state = load_file(str(weights))
    expected = unet.state_dict()
    wrong = sorted(set(state) ^ set(expected)) or [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if wrong:
        raise ConfigError(f"federate.init={str(folder)!r} holds a different UNet (size, classes or image shape): first "
                          f"mismatch at {wrong[0]!r}")
    unet.load_state_dict(state)
