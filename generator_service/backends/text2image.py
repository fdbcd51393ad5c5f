"""The `text2image` backend: an off-the-shelf diffusers text-to-image pipeline (SD-turbo, SDXL-turbo, ordinary SD)
saved in a local folder, prompted by class name, its images resized to the dataset's resolution.

Image j of class c for request seed s is a pure function of (folder, prompts, steps, guidance, s, c, j): every row's
starting latents come from its own CPU `torch.Generator` seeded by (s, c, j) (a per-image generator list, which the
pipeline also hands to an ancestral scheduler's per-step noise), and, as for `ddpm`, the pipeline always runs on
`--max-batch` rows (unused rows repeat the first key) because CPU kernels give slightly different floats for
different batch sizes. Nothing is ever downloaded: the folder is loaded with `local_files_only`.

Variations (Vary) run diffusers' image-to-image pipeline of the same components (`AutoPipelineForImage2Image.from_pipe`,
no second copy of the weights): each source upscaled to the pipeline's resolution, re-run for the share of the steps its
strength picks, with the same per-row generators, resized back like a fresh image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsynth.config import DEFAULT_PROMPT_TEMPLATE, check_prompt_template
from fedsynth.config_schema import CIFAR10_CLASSES, CIFAR100_CLASSES
from fedsynth.errors import ConfigError
from generator_service.backends import BackendDescription, BackendSettings, BackendSpec, Unservable

if TYPE_CHECKING:
    from generator_service.ddpm.sampling import ImageKey

DEFAULT_STEPS = 4  # SD-turbo / SDXL-turbo style: 1-4 steps, no guidance; ordinary SD wants ~25 steps and w ~6.5
DEFAULT_GUIDANCE = 0.0  # w, as for ddpm: diffusers' guidance_scale = 1 + w (<= 1 turns classifier-free guidance off)
PIPELINE_INDEX = "model_index.json"  # what pipeline.save_pretrained(DIR) writes first

DIGIT_NAMES = tuple(f"handwritten digit {d}" for d in range(10))
# name -> (class names, (channels, height, width)); npz takes its shape from the data and its names from a file.
BUILT_IN: dict[str, tuple[tuple[str, ...], tuple[int, int, int]]] = {
    "digits": (DIGIT_NAMES, (1, 8, 8)),
    "cifar10": (CIFAR10_CLASSES, (3, 32, 32)),
    "cifar100": (CIFAR100_CLASSES, (3, 32, 32)),
}


def check_template(template: str) -> None:
    """A template names exactly one field, {name}; anything else is refused (no silent literal braces)."""
    check_prompt_template(template, key="--prompt-template")


def read_class_names(path: Path, num_classes: int | None = None) -> tuple[str, ...]:
    """One class name per line (UTF-8), class 0 first; blank lines and surrounding spaces are dropped."""
    try:
        names = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    except OSError as exc:
        raise ConfigError(f"class names file {str(path)!r} cannot be read: {exc.strerror}") from exc
    if num_classes is not None and len(names) != num_classes:
        raise ConfigError(f"class names file {str(path)!r} names {len(names)} classes; the dataset has {num_classes}")
    return names


def class_names(dataset: str, *, data_dir: Path | None = None,
                names_file: Path | None = None) -> tuple[tuple[str, ...], tuple[int, int, int]]:
    """The dataset's class names (underscores as spaces) and image shape (channels, height, width)."""
    if dataset in BUILT_IN:
        names, shape = BUILT_IN[dataset]
        if names_file is not None:
            names = read_class_names(names_file, len(names))
    else:
        if names_file is None:
            raise ConfigError(f"--backend text2image with --dataset {dataset} needs --class-names-file "
                              "(generation.class_names_file): one class name per line")
        from fedsynth.learning.data import load_dataset

        data = load_dataset(dataset, "train", data_dir=data_dir)
        names, shape = read_class_names(names_file, data.num_classes), data.image_shape
    return tuple(name.replace("_", " ") for name in names), shape


def check_folder(model_dir: Path) -> None:
    """One clear line for a folder that is not a saved diffusers pipeline (nothing is downloaded instead)."""
    if not model_dir.is_dir():
        raise ConfigError(f"text2image model folder {str(model_dir)!r} does not exist (it is never downloaded: "
                          "save a pipeline there with pipeline.save_pretrained(DIR), see docs/generator.md)")
    if not (model_dir / PIPELINE_INDEX).is_file():
        raise ConfigError(f"text2image model folder {str(model_dir)!r} holds no diffusers pipeline "
                          f"({PIPELINE_INDEX} is missing; save one with pipeline.save_pretrained(DIR))")


def folder_digest(model_dir: Path) -> hashlib._Hash:
    """SHA-256 over every file of the folder (relative path and bytes, sorted by path)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(model_dir)).encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest


class Text2ImageBackend:
    """Serves every class it has a name for; the pipeline always runs on batch_size rows."""

    def __init__(self, pipeline: Any, prompts: Sequence[str], *, image_shape: tuple[int, int, int], steps: int,
                 guidance: float, batch_size: int, device: torch.device, description: BackendDescription,
                 img2img: Any = None) -> None:
        self.pipeline = pipeline
        self.img2img = img2img  # the image-to-image pipeline sharing pipeline's components; None: no variations
        self.prompts = tuple(prompts)
        self.image_shape = image_shape
        self.steps = steps
        self.guidance = guidance
        self.batch_size = batch_size
        self.device = device
        self._description = description

    @property
    def description(self) -> BackendDescription:
        return self._description

    def check_counts(self, counts: Sequence[int]) -> None:
        return None  # every class has a prompt

    def check_variations(self) -> None:
        if self.img2img is None:
            raise Unservable(f"the text2image pipeline {type(self.pipeline).__name__} has no image-to-image "
                             "counterpart in diffusers, so this server makes no variations")

    @torch.no_grad()
    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        """Fresh images and variations mixed: each group of rows (sampling.group_rows) runs as its own padded batch."""
        from generator_service.ddpm.sampling import group_rows

        count, size = len(keys), self.batch_size
        if not 1 <= count <= size:
            raise ValueError(f"sample() takes 1..{size} keys, got {count}")
        for key in keys:
            if not 0 <= key.class_id < len(self.prompts):
                raise ValueError(f"class id {key.class_id} out of range 0..{len(self.prompts) - 1}")
        channels, height, width = self.image_shape
        images = np.empty((count, height, width, channels), dtype=np.uint8)
        for rows, rerun in group_rows(keys, self.steps):
            group = [keys[row] for row in rows]
            images[rows] = self._generate(group) if rerun is None else self._vary(group, rerun)
        return images

    def _generate(self, keys: Sequence[ImageKey]) -> np.ndarray:
        from generator_service.ddpm.sampling import noise_seed

        count, size = len(keys), self.batch_size
        rows = list(keys) + [keys[0]] * (size - count)  # padding rows: results dropped, row-independent anyway
        generators = [torch.Generator(device="cpu").manual_seed(noise_seed(key)) for key in rows]
        result = self.pipeline(
            prompt=[self.prompts[key.class_id] for key in rows], num_inference_steps=self.steps,
            guidance_scale=1.0 + self.guidance, generator=generators, output_type="pt",
        ).images[:count]
        return to_dataset_images(result, self.image_shape)

    def _vary(self, keys: Sequence[ImageKey], rerun: int) -> np.ndarray:
        """img2img over `rerun` of the `steps` steps; the sources, in [0, 1], upscaled to the pipeline's resolution."""
        from generator_service.ddpm.sampling import VariationKey, noise_seed, source_pixels

        self.check_variations()
        count, size = len(keys), self.batch_size
        rows = list(keys) + [keys[0]] * (size - count)
        sources = []
        for key in rows:
            assert isinstance(key, VariationKey)
            sources.append(source_pixels(key, self.image_shape))
        native = self.native_size()
        x = torch.stack(sources)
        if x.shape[1] == 1:
            x = x.repeat(1, 3, 1, 1)
        x = torch.nn.functional.interpolate(x, size=(native, native), mode="bilinear", antialias=False,
                                            align_corners=False).clamp(0.0, 1.0)
        generators = [torch.Generator(device="cpu").manual_seed(noise_seed(key)) for key in rows]
        # The pipeline re-runs int(steps * strength) steps: (rerun + 0.5) / steps makes that exactly `rerun`.
        strength = min(1.0, (rerun + 0.5) / self.steps)
        result = self.img2img(
            prompt=[self.prompts[key.class_id] for key in rows], image=x, strength=strength,
            num_inference_steps=self.steps, guidance_scale=1.0 + self.guidance, generator=generators,
            output_type="pt",
        ).images[:count]
        return to_dataset_images(result, self.image_shape)

    def native_size(self) -> int:
        """The side of the images the pipeline draws: its UNet's sample size times the VAE's downscale factor."""
        sample_size = self.pipeline.unet.config.sample_size
        side = sample_size if isinstance(sample_size, int) else sample_size[0]
        return int(side) * int(self.pipeline.vae_scale_factor)


def to_dataset_images(images: torch.Tensor, image_shape: tuple[int, int, int]) -> np.ndarray:
    """[0, 1] floats N x 3 x h x w -> uint8 N x H x W x C: antialiased bilinear resize, luma for one channel."""
    channels, height, width = image_shape
    x = images.detach().float().cpu()
    if x.shape[-2:] != (height, width):
        x = torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear", antialias=True,
                                            align_corners=False)
    if channels == 1:
        x = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(dim=1, keepdim=True)  # ITU-R 601 luma
    elif channels != 3:
        raise ConfigError(f"text2image serves 1- or 3-channel datasets, not {channels} channels")
    return (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def load_text2image(model_dir: Path, *, dataset: str, data_dir: Path | None = None, names_file: Path | None = None,
                    template: str | None = None, device: str = "auto", batch_size: int, steps: int | None = None,
                    guidance: float | None = None, threads: int = 0) -> Text2ImageBackend:
    """Load a saved pipeline from model_dir (local files only) and the prompts of `dataset`'s classes."""
    from generator_service.ddpm.sampling import compute_dtype, resolve_device

    check_folder(model_dir)
    template = DEFAULT_PROMPT_TEMPLATE if template is None else template
    check_template(template)
    names, shape = class_names(dataset, data_dir=data_dir, names_file=names_file)
    prompts = [template.format(name=name) for name in names]
    steps = DEFAULT_STEPS if steps is None else steps
    guidance = DEFAULT_GUIDANCE if guidance is None else guidance
    if threads:
        torch.set_num_threads(threads)
    target = resolve_device(device)
    dtype = compute_dtype(target)
    from diffusers import AutoPipelineForText2Image

    try:
        # use_safetensors: never unpickle a folder's .bin weights (fedsynth loads no pickle, even the operator's)
        pipeline = AutoPipelineForText2Image.from_pretrained(model_dir, local_files_only=True, torch_dtype=dtype,
                                                             use_safetensors=True)
    except (OSError, ValueError) as exc:  # e.g. a component's weights missing from the folder
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"text2image model folder {str(model_dir)!r} could not be loaded: {first}") from exc
    pipeline = pipeline.to(target)
    pipeline.set_progress_bar_config(disable=True)
    img2img = image_to_image(pipeline)
    if target.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    parameters = sum(p.numel() for component in pipeline.components.values()
                     if isinstance(component, torch.nn.Module) for p in component.parameters())
    digest = folder_digest(model_dir)
    digest.update(repr((prompts, shape, steps, guidance)).encode())  # what else decides the bytes
    description = BackendDescription(
        backend="text2image", model_id=f"text2image-{dataset}-{digest.hexdigest()[:12]}", dataset=dataset,
        num_classes=len(names), image_shape=shape, device=target.type, dtype=str(dtype).removeprefix("torch."),
        size=type(pipeline).__name__, parameters=parameters, ddim_steps=steps, guidance=guidance,
    )
    return Text2ImageBackend(pipeline, prompts, image_shape=shape, steps=steps, guidance=guidance,
                             batch_size=batch_size, device=target, description=description, img2img=img2img)


def image_to_image(pipeline: Any) -> Any:
    """diffusers' image-to-image pipeline sharing `pipeline`'s components (no copy of the weights), or None where
    diffusers has none for this pipeline class. Both run on the batcher's one worker thread, so sharing the (stateful)
    scheduler is safe: every call sets its timesteps afresh."""
    from diffusers import AutoPipelineForImage2Image

    try:
        img2img = AutoPipelineForImage2Image.from_pipe(pipeline)
    except ValueError:  # "AutoPipeline can't find a pipeline linked to ..."
        return None
    img2img.set_progress_bar_config(disable=True)
    return img2img


def _check(config: BackendSettings) -> None:
    assert config.model is not None  # serve_cmd.ServeConfig requires --model and --dataset for this backend
    check_folder(config.model)
    if config.prompt_template is not None:
        check_template(config.prompt_template)


def _load(config: BackendSettings) -> Text2ImageBackend:
    assert config.model is not None and config.dataset is not None
    return load_text2image(config.model, dataset=config.dataset, data_dir=config.data_dir,
                           names_file=config.class_names_file, template=config.prompt_template, device=config.device,
                           batch_size=config.max_batch, steps=config.ddim_steps, guidance=config.guidance,
                           threads=config.threads)


BACKEND = BackendSpec("text2image", load=_load, check=_check)
