"""The `ddpm` backend: a trained generator folder sampled by the deterministic DDIM sampler (fresh images and, for
Vary, SDEdit variations)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from generator_service.backends import BackendDescription, BackendSettings, BackendSpec, GeneratorBackend
from generator_service.ddpm.model import load_generator, read_metadata
from generator_service.ddpm.sampling import DdimSampler, ImageKey, SamplingConfig, resolve_device


class DdpmBackend:
    """Serves any class the model was trained on; the UNet always runs on batch_size rows (see DdimSampler)."""

    def __init__(self, sampler: DdimSampler, description: BackendDescription) -> None:
        self.sampler = sampler
        self._description = description

    @property
    def description(self) -> BackendDescription:
        return self._description

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        return self.sampler.sample(keys)  # ImageKeys and VariationKeys alike

    def check_counts(self, counts: Sequence[int]) -> None:
        return None  # a class-conditional model can draw every class it knows

    def check_variations(self) -> None:
        return None  # SDEdit: DdimSampler takes VariationKeys


def load_ddpm(model_dir: Path, *, device: str = "auto", batch_size: int, ddim_steps: int | None = None,
              guidance: float | None = None, threads: int = 0) -> DdpmBackend:
    """Load a folder from `fedsynth generator train`; ddim_steps / guidance None take the folder's defaults."""
    if threads:
        torch.set_num_threads(threads)
    loaded = load_generator(model_dir)
    meta = loaded.metadata
    sampling = SamplingConfig(meta.ddim_steps if ddim_steps is None else ddim_steps,
                              meta.guidance if guidance is None else guidance, batch_size)
    target = resolve_device(device)
    sampler = DdimSampler(loaded.unet, loaded.scheduler_config, num_classes=meta.num_classes,
                          image_shape=meta.image_shape, config=sampling, device=target)
    # The served images are a function of the weights AND the sampling settings: the id names all three, so a client
    # cache (keyed by it) is never reused across other steps or guidance, and replicas must agree on both.
    served_id = f"{meta.model_id}-s{sampling.steps}-w{sampling.guidance:g}"
    description = BackendDescription(
        backend="ddpm", model_id=served_id, dataset=meta.dataset, num_classes=meta.num_classes,
        image_shape=meta.image_shape, device=target.type, dtype=str(sampler.dtype).removeprefix("torch."),
        size=meta.size, parameters=meta.parameters, ddim_steps=sampling.steps, guidance=sampling.guidance,
    )
    return DdpmBackend(sampler, description)


def _check(config: BackendSettings) -> None:
    assert config.model is not None  # serve_cmd.ServeConfig requires --model for this backend
    read_metadata(config.model)  # a wrong folder fails here, before the server binds anything


def _load(config: BackendSettings) -> GeneratorBackend:
    assert config.model is not None
    from generator_service.evolved import wrap_if_evolved  # `generator evolve`'s folders: the evolved set over the model

    return wrap_if_evolved(config.model, load_ddpm(config.model, device=config.device, batch_size=config.max_batch,  # type: ignore[return-value]
                                                   ddim_steps=config.ddim_steps, guidance=config.guidance, threads=config.threads))


BACKEND = BackendSpec("ddpm", load=_load, check=_check)
