"""The class-conditional UNet by size name, and the generator folder: diffusers weights plus our metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diffusers import DDPMScheduler, UNet2DModel

from fedsynth.errors import ConfigError
# The sizes, builder and schedule live in the shared library (federated clients train the same UNet); re-exported here.
from fedsynth.learning.unet import NUM_TRAIN_TIMESTEPS, SIZES, WEIGHTS_FILE, UNetSize, build_unet, make_train_scheduler, parameter_count  # noqa: F401
from fedsynth.generation.generator_names import METADATA_FILE
from fedsynth.process.runtime import write_atomic

METADATA_FORMAT = 1


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
