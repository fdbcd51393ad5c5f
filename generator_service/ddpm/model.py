"""The class-conditional UNet by size name, and the generator folder: diffusers weights plus our metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import DDPMScheduler, UNet2DModel

from fedsynth.config_schema import GENERATOR_SIZES, require_names
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import METADATA_FILE
from fedsynth.process.runtime import write_atomic

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
METADATA_FORMAT = 1
NUM_TRAIN_TIMESTEPS = 1000


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
require_names("generator_service.ddpm.model.SIZES", SIZES, GENERATOR_SIZES)  # the names the config check offers


def build_unet(size: str, *, num_classes: int, image_shape: tuple[int, int, int], seed: int = 0) -> UNet2DModel:
    """A freshly initialised UNet; class index num_classes is the null label used for classifier-free guidance."""
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


@dataclass(frozen=True)
class GeneratorMetadata:
    """Our description of a generator folder, stored next to the diffusers files as fedsynth_generator.json."""

    dataset: str
    num_classes: int
    image_shape: tuple[int, int, int]  # (channels, height, width)
    size: str
    training_steps: int
    guidance: float
    ddim_steps: int
    model_id: str = ""
    parameters: int = 0
    backend: str = "ddpm"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ConfigError(f"unknown generator size {self.size!r}; expected one of {', '.join(SIZES)}")
        if self.num_classes < 1 or len(self.image_shape) != 3 or min(self.image_shape) < 1:
            raise ConfigError(f"bad generator shape: {self.num_classes} classes, image shape {self.image_shape}")
        if self.ddim_steps < 1 or self.guidance < 0:
            raise ConfigError(f"bad sampling defaults: ddim_steps={self.ddim_steps}, guidance={self.guidance}")


@dataclass(frozen=True)
class LoadedGenerator:
    unet: UNet2DModel
    scheduler_config: dict[str, Any]
    metadata: GeneratorMetadata


def _weights_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    with open(folder / WEIGHTS_FILE, "rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def save_generator(folder: Path, unet: UNet2DModel, scheduler: DDPMScheduler, metadata: GeneratorMetadata) -> GeneratorMetadata:
    """Write weights, scheduler config, then the metadata LAST (atomically): its presence marks a complete folder."""
    folder.mkdir(parents=True, exist_ok=True)
    unet.save_pretrained(folder, safe_serialization=True)
    scheduler.save_pretrained(folder)
    model_id = f"ddpm-{metadata.size}-{metadata.dataset}-{_weights_hash(folder)}"
    final = GeneratorMetadata(**{**asdict(metadata), "model_id": model_id, "parameters": parameter_count(unet)})
    write_atomic(folder / METADATA_FILE, json.dumps({"format": METADATA_FORMAT, **asdict(final)}, indent=2) + "\n")
    return final


def read_metadata(folder: Path) -> GeneratorMetadata:
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise ConfigError(f"{folder} is not a generator folder: {METADATA_FILE} is missing (train one with `fedsynth generator train`)")
    try:
        raw = json.loads(path.read_text())
        if raw.pop("format", None) != METADATA_FORMAT:
            raise ConfigError(f"{path}: unsupported metadata format (expected {METADATA_FORMAT})")
        raw["image_shape"] = tuple(raw["image_shape"])
        return GeneratorMetadata(**raw)
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path}: malformed generator metadata ({exc})") from exc


def is_generator_folder(folder: Path) -> bool:
    return (Path(folder) / METADATA_FILE).is_file()


def load_generator(folder: Path) -> LoadedGenerator:
    """Load a folder written by save_generator; the weights come from safetensors, never pickle."""
    folder = Path(folder)
    metadata = read_metadata(folder)
    unet = UNet2DModel.from_pretrained(folder, use_safetensors=True, low_cpu_mem_usage=False)
    if unet.config.num_class_embeds != metadata.num_classes + 1:
        raise ConfigError(
            f"{folder}: the UNet has {unet.config.num_class_embeds} class embeddings, "
            f"expected num_classes + 1 = {metadata.num_classes + 1}"
        )
    channels, height, _ = metadata.image_shape
    if (unet.config.in_channels, unet.config.sample_size) != (channels, height):
        raise ConfigError(
            f"{folder}: the UNet takes {unet.config.in_channels} channels at {unet.config.sample_size} pixels, "
            f"but the metadata says image shape {metadata.image_shape}"
        )
    unet.eval()
    return LoadedGenerator(unet, dict(DDPMScheduler.load_config(folder)), metadata)
