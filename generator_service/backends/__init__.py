"""Generator backends behind one interface, by name: `ddpm` (a trained diffusion model), `holdout` (real held-out images),
`text2image` (an off-the-shelf diffusers text-to-image pipeline prompted by class name)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fedsynth.config_schema import GENERATOR_BACKENDS
from fedsynth.errors import ConfigError

if TYPE_CHECKING:
    from generator_service.ddpm.sampling import ImageKey

# name (fedsynth.config_schema.GENERATOR_BACKENDS) -> the module of that name defining BACKEND; imported on first use,
# so a holdout server never loads the UNet code it skips.
BACKENDS: dict[str, str] = {name: f"{__name__}.{name}" for name in GENERATOR_BACKENDS}


class Unservable(Exception):
    """The backend cannot serve a request as asked (e.g. a class it has no image of); answered FAILED_PRECONDITION."""


class PartlyUnservable(Unservable):
    """sample() served some keys and not others: `images` has a row per key, valid except at `failed_rows`. The
    batcher fails only the requests owning a failed row, with this message, and delivers the rest."""

    def __init__(self, message: str, images: np.ndarray, failed_rows: frozenset[int]) -> None:
        super().__init__(message)
        self.images = images
        self.failed_rows = failed_rows


@dataclass(frozen=True)
class BackendDescription:
    """What Info and the metrics report about the loaded backend (fields that do not apply stay empty / 0)."""

    backend: str
    model_id: str
    dataset: str
    num_classes: int
    image_shape: tuple[int, int, int]  # (channels, height, width)
    device: str
    dtype: str
    size: str = ""
    parameters: int = 0
    ddim_steps: int = 0
    guidance: float = 0.0


class GeneratorBackend(Protocol):
    """A loaded backend: every image is a pure function of its key, whatever else shares its batch."""

    @property
    def description(self) -> BackendDescription: ...

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        """uint8 images N x H x W x C, one per key, for 1 <= N <= the server's max batch. A key may be a VariationKey
        (a subclass) only where check_variations(backend) passes."""
        ...

    def check_counts(self, counts: Sequence[int]) -> None:
        """Raise Unservable, naming the class, for per-class counts this backend cannot serve."""
        ...


class BackendSettings(Protocol):
    """The server settings a backend reads (serve_cmd.ServeConfig has them). Backends depend on this, not on the
    command that parses the flags, so that serve_cmd imports the backends and never the other way round."""

    @property
    def backend(self) -> str: ...
    @property
    def model(self) -> Path | None: ...  # ddpm: the generator folder; text2image: the saved pipeline
    @property
    def device(self) -> str: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def ddim_steps(self) -> int | None: ...  # None: the folder's default
    @property
    def guidance(self) -> float | None: ...
    @property
    def threads(self) -> int: ...
    @property
    def dataset(self) -> str | None: ...  # holdout: the run's data.dataset, data_dir, holdout_fraction and seed
    @property
    def data_dir(self) -> Path | None: ...
    @property
    def holdout_fraction(self) -> float | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def holdout_dir(self) -> Path | None: ...  # holdout in local mode: a folder of held-out images (data split's)
    @property
    def prompt_template(self) -> str | None: ...  # text2image: "a photo of a {name}" when None
    @property
    def class_names_file(self) -> Path | None: ...  # text2image: one class name per line (npz needs one)


def check_variations(backend: GeneratorBackend) -> None:
    """Raise Unservable, saying why, unless backend.sample() also makes variations (VariationKey, for Vary). A backend
    opts in with a check_variations() method of its own (ddpm, text2image; holdout's refuses). Without one it makes
    none: a VariationKey is an ImageKey, so a backend that does not look for it would serve a fresh image instead."""
    check = getattr(backend, "check_variations", None)
    if callable(check):
        check()
        return
    if hasattr(backend, "inner"):  # the quality filter wraps the loaded backend
        raise Unservable("this server runs the quality filter (--min-confidence), which serves Generate only: it "
                         "would judge and redraw a variation as a fresh image; ask a server without --min-confidence "
                         "for variations")
    raise Unservable(f"the {backend.description.backend} backend makes no variations")


@dataclass(frozen=True)
class BackendSpec:
    """load() is the slow part (done while health says NOT_SERVING); check(), if any, fails fast before binding."""

    name: str
    load: Callable[[BackendSettings], GeneratorBackend]
    check: Callable[[BackendSettings], None] | None = None


def get_backend(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ConfigError(f"unknown generator backend {name!r}; expected one of {', '.join(BACKENDS)}")
    spec = importlib.import_module(BACKENDS[name]).BACKEND
    assert isinstance(spec, BackendSpec) and spec.name == name
    return spec


def build_backend(config: BackendSettings) -> GeneratorBackend:
    """Load the backend named by config.backend with the settings in config."""
    return get_backend(config.backend).load(config)
