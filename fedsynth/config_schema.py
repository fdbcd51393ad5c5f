"""The config's checks: one typed check driven by each field's annotation, range rules, and the names keys choose from.

The names and each algorithm's parameter bounds are defined HERE and nowhere else: the tables that serve them
(fedsynth.learning.models' builders, fedsynth.algorithms.ALGORITHMS, generator_service.backends.BACKENDS,
fedsynth.learning.unet.SIZES, ...) import them and check their keys with `require_names` when imported.
This module imports neither torch nor a role package, so reading a config loads neither.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, ClassVar

from fedsynth.errors import ConfigError

DATASETS = ("digits", "cifar10", "cifar100", "npz")  # fedsynth.learning.data
POLICIES = ("none", "fedeas", "uniform", "missing", "full")  # fedsynth.allocation
PARTITIONS = ("dirichlet", "iid")  # fedsynth.learning.partition
ACCOUNTANTS = ("rdp", "prv")  # generator_service.dpgan (Opacus accountants)
# train.model's built-in classifiers (fedsynth.learning.models.build_model); beside them train.model takes
# torchvision:<builder> and package.module:factory (model_form below: their syntax, nothing imported).
CLASSIFIER_MODELS = ("cnn", "resnet18")
# The class-conditional DDPM UNet of each generator size (fedsynth.learning.unet): trained only by the "ddpm" algorithm
# (`fedsynth generator federate` sets train.model to one), so train.model accepts them but its error never lists them.
UNET_MODELS = ("unet-tiny", "unet-small", "unet-half", "unet-ddpm-cifar")
# Private Evolution's "model" (train.algorithm = "pe", `fedsynth generator evolve`): one vote per candidate image.
PE_MODEL = "pe-votes"
MODELS = CLASSIFIER_MODELS + UNET_MODELS  # every built-in name build_model knows
TORCHVISION_PREFIX = "torchvision:"  # train.model = "torchvision:<builder>": a classification builder of torchvision.models
GENERATOR_BACKENDS = ("ddpm", "holdout", "text2image")  # generator_service.backends; holdout: real held-out images
GENERATOR_SIZES = ("tiny", "small", "half", "ddpm-cifar")  # fedsynth.learning.unet.SIZES
# `generator train`'s default AdamW lr by size. 2e-3 trains the two CPU sizes in few steps; at 2e-3 "half" collapsed on
# digits (after 1,500 steps it predicted ~0 noise and drew noise: docs/generator.md), so the DDPM-CIFAR layouts take
# Ho et al.'s 2e-4. The launcher names the lr in a cached model's folder where it is not the 2e-3 of older folders.
GENERATOR_TRAIN_LR = {"tiny": 2e-3, "small": 2e-3, "half": 2e-4, "ddpm-cifar": 2e-4}
# The image side each UNet size takes must be divisible by this (2 to the number of down-samplings; unet.SIZES checks
# it agrees): what the launcher checks data.image_size against before it trains a generator on first use.
GENERATOR_SIDE_DIVISOR = {"tiny": 2, "small": 4, "half": 8, "ddpm-cifar": 8}
WIRE_DTYPES = ("float32", "float16", "bfloat16")  # fedsynth.wire.wire_dtype: the floats of client updates on the wire
DP_LEVELS = ("none", "user", "sample")  # federate.dp: none, DP-FedAvg (a client's whole data), DP-SGD (one image)
# evolve.embedder: the public feature extractor Private Evolution's votes are cast in: the pixels themselves, or a
# classifier trained on public data (evolve.embedder_model; fedsynth.learning.public_embedder)
EMBEDDERS = ("pixels", "classifier")
EVALUATIONS = ("server", "federated", "both")  # who tests the global model: the coordinator, the clients (counts), or both
DATA_PLANES = ("grpc", "tcp")  # how model payloads travel: chunks on the gRPC streams, or fedsynth.wire.data_plane beside them
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision: fp32, or autocast to bfloat16 / float16 (with a GradScaler)
OPTIMIZERS = ("sgd", "adam", "adamw")  # train.optimizer: the clients' local optimizer (fresh each round)
LR_SCHEDULES = ("constant", "cosine", "step")  # train.lr_schedule: the clients' lr as a function of the round
AGGREGATIONS = ("mean", "median", "trimmed_mean", "krum", "multi_krum")  # train.aggregation (fedsynth.algorithms.robust)
UPDATE_NORM_ACTIONS = ("refuse", "clip")  # coordinator.update_norms: what becomes of an update past runtime.max_update_norm
DATA_SOURCES = ("split", "local")  # data.source: a seeded split of one dataset, or each client's own folder
DATA_FORMATS = ("imagefolder", "npz", "hf")  # `fedsynth data split --format` (fedsynth.learning.split_export)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_CLASSES = tuple("""
apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly camel can castle
caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup dinosaur dolphin elephant flatfish
forest fox girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle
mountain mouse mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy porcupine
possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel streetcar
sunflower sweet_pepper table tank telephone television tiger tractor train trout tulip turtle wardrobe whale
willow_tree wolf woman worm""".split())  # torchvision's CIFAR-100 fine-label order
# The label schema each built-in dataset brings (data.classes, data.image_size, data.channels when left out).
BUILTIN_SCHEMAS: dict[str, tuple[tuple[str, ...], int, int]] = {
    "digits": (tuple(str(d) for d in range(10)), 8, 1),
    "cifar10": (CIFAR10_CLASSES, 32, 3),
    "cifar100": (CIFAR100_CLASSES, 32, 3),
}
MAX_EXPONENT = 2.0  # generation.exponent / plan --exponent: past (N_k / C)^2 no generator could fill a budget


def model_form(value: str, builtins: tuple[str, ...] = MODELS) -> str | None:
    """The form of a train.model value by its syntax alone: "builtin" (one of `builtins`), "torchvision"
    (torchvision:IDENTIFIER), "factory" (a dotted module path of identifiers, a colon, an identifier), or None."""
    if value in builtins:
        return "builtin"
    module, colon, attr = value.partition(":")
    if not colon or not attr.isidentifier():
        return None
    if module == TORCHVISION_PREFIX[:-1]:
        return "torchvision"
    if all(part.isidentifier() for part in module.split(".")):
        return "factory"
    return None


@dataclass(frozen=True)
class Bound:
    """The values one algorithm parameter takes: a finite number (an integer if `integer`) >= low, or > low if
    `strict`, and <= high. bool is never a number."""

    low: float
    strict: bool = False
    integer: bool = False
    high: float = math.inf

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and (self.integer or not math.isfinite(value)):
            return False
        return (value > self.low if self.strict else value >= self.low) and value <= self.high

    def __str__(self) -> str:
        upper = f" and <= {self.high}" if self.high < math.inf else ""
        return f"{'an integer' if self.integer else 'a finite number'} {'>' if self.strict else '>='} {self.low}{upper}"


# train.aggregation_params by rule: trimmed_mean's share cut at each end; krum's and multi_krum's assumed attackers f
# (0: the most the round allows, floor((n - 3) / 2)) and multi_krum's m (0: n - f).
AGGREGATION_PARAMS: dict[str, dict[str, Bound]] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"beta": Bound(0, high=0.49)},
    "krum": {"f": Bound(0, integer=True)},
    "multi_krum": {"f": Bound(0, integer=True), "m": Bound(0, integer=True)},
}
AGGREGATION_DEFAULTS: dict[str, dict[str, int | float]] = {
    "mean": {}, "median": {}, "trimmed_mean": {"beta": 0.1}, "krum": {"f": 0}, "multi_krum": {"f": 0, "m": 0},
}

# Each algorithm's parameters (the fields of its dataclass in fedsynth.algorithms, in order) and their bounds: the
# config check and the algorithm's own check both read them. The defaults stay in the dataclasses.
ALGORITHM_PARAMS: dict[str, dict[str, Bound]] = {
    "fedavg": {},
    "fedprox": {"mu": Bound(0)},
    "scaffold": {"num_clients": Bound(1, integer=True), "global_lr": Bound(0, strict=True)},
    # MOON's projection head (the authors' l1-ReLU-l2 MLP to 256-d, classifier on its output); 0: contrast the
    # representation itself.
    "moon": {"mu": Bound(0), "temperature": Bound(0, strict=True), "projection_dim": Bound(0, integer=True)},
    "sdafl": {"lambda2": Bound(0), "mixup_alpha": Bound(0, strict=True)},
    # M images per mean (M = 1 would upload raw images) and the mixup weight lambda.
    "fedmix": {"mean_batch": Bound(2, integer=True), "lam": Bound(0, high=1)},
    "naivemix": {"mean_batch": Bound(2, integer=True), "lam": Bound(0, high=1)},
    # The clients' regularizer weights and their per-round decay; the server's generator steps, batch and Adam lr.
    "fedgen": {"alpha": Bound(0), "beta": Bound(0), "decay": Bound(0, strict=True, high=1), "gen_steps": Bound(0, integer=True),
               "gen_batch_size": Bound(1, integer=True), "gen_lr": Bound(0, strict=True)},
    # The federated class-conditional DDPM: its settings are the [federate] section's (fedsynth.config.FederateConfig).
    "ddpm": {},
    # Private Evolution over a public generator: its settings are the [evolve] section's (fedsynth.config.EvolveConfig).
    "pe": {},
}
ALGORITHMS = tuple(ALGORITHM_PARAMS)


def check_parameter(algorithm: str, param: str, value: object, *, key: str) -> None:
    """ConfigError naming `key` unless `value` is within the bound of `algorithm`'s parameter `param`."""
    bound = ALGORITHM_PARAMS[algorithm][param]
    if not bound.accepts(value):
        raise ConfigError(f"{key} must be {bound} for {algorithm}, got {value!r}")


def require_names(table: str, keys: Iterable[str], names: tuple[str, ...]) -> None:
    """For a table keyed by names defined here, called when its module is imported: its keys must be `names`, in
    order (a mismatch is a programming error, raised even under `python -O`)."""
    found = tuple(keys)
    if found != names:
        raise AssertionError(f"{table} is keyed by {found}, but fedsynth.config_schema names {names}")


MAX_PORT = 65535


def _describe(hint: Any) -> str:
    if _is_union(hint):
        real = [option for option in typing.get_args(hint) if option is not type(None)]
        optional = len(real) < len(typing.get_args(hint))
        return " or ".join(_describe(option) for option in real) + (" (or left out)" if optional else "")
    if typing.get_origin(hint) is dict or is_dataclass(hint):
        return "a table"
    if typing.get_origin(hint) is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[hint]


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def check_value(key: str, value: Any, hint: Any) -> Any:
    """`value` as the annotation `hint` wants it (an integer where a float is wanted becomes a float); else a
    ConfigError naming `key`. bool is never taken for a number, and a float must be finite."""
    if _is_union(hint):
        if value is None and type(None) in typing.get_args(hint):
            return None
        for option in typing.get_args(hint):
            if option is not type(None):
                try:
                    return check_value(key, value, option)
                except ConfigError:
                    pass
    elif typing.get_origin(hint) is dict and isinstance(value, dict):
        _, value_hint = typing.get_args(hint)
        return {name: check_value(f"{key}.{name}", item, value_hint) for name, item in value.items()}
    elif typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):  # tuple[X, ...]: a TOML array
        item_hint = typing.get_args(hint)[0]
        return tuple(check_value(f"{key}[{i}]", item, item_hint) for i, item in enumerate(value))
    elif is_dataclass(hint) and isinstance(value, hint):
        return value
    elif hint is bool and isinstance(value, bool):
        return value
    elif hint is int and isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value  # TOML's integer range: JSON could carry more
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value):
        return float(value)
    elif hint is str and isinstance(value, str):
        return value
    raise ConfigError(f"{key} must be {_describe(hint)}, got {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Section:
    """Base of the frozen config dataclasses: every field's type is checked (from its annotation) when one is made,
    then the section's `check` applies its ranges. Errors name `section.key` and the value, in one line."""

    SECTION: ClassVar[str] = ""  # "" at the top level, where keys have no prefix

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, check_value(self.key(f.name), getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Ranges and choices of this section's keys; types are already right."""

    def key(self, name: str) -> str:
        return f"{self.SECTION}.{name}" if self.SECTION else name

    def _fail(self, name: str, wanted: str) -> None:
        raise ConfigError(f"{self.key(name)} must be {wanted}, got {getattr(self, name)!r}")

    def at_least(self, low: float, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < low:
                self._fail(name, f">= {low}")

    def above(self, low: float, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and not value > low:
                self._fail(name, f"> {low}")

    def within(self, name: str, low: float, high: float, *, high_open: bool = False, low_open: bool = False) -> None:
        value = getattr(self, name)
        if (value <= low if low_open else value < low) or (value >= high if high_open else value > high):
            self._fail(name, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")

    def one_of(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            self._fail(name, f"one of {', '.join(choices)}")

    def model_spec(self, name: str, builtins: tuple[str, ...], internal: tuple[str, ...] = ()) -> None:
        """A built-in model name, torchvision:<builder> or package.module:factory, by syntax alone (nothing is
        imported); `internal` names are accepted too but never listed in the error."""
        value = getattr(self, name)
        if value not in internal and model_form(value, builtins) is None:
            self._fail(name, f"{', '.join(builtins)}, {TORCHVISION_PREFIX}<builder> or package.module:factory")

    def non_empty(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and not value.strip():
                self._fail(name, "a non-empty string")

    def address(self, name: str) -> None:
        """HOST:PORT with a port in 1..65535 (None passes: the key is optional)."""
        value = getattr(self, name)
        if value is None:
            return
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
            self._fail(name, f"HOST:PORT with a port in 1..{MAX_PORT}")

    def bounded(self, name: str, bound: Bound) -> None:
        if not bound.accepts(getattr(self, name)):
            self._fail(name, str(bound))

    def parameters_of(self, algorithm: str, name: str, table: dict[str, dict[str, Bound]] | None = None) -> None:
        """Each entry of the dict field `name`: a parameter of `algorithm` (a key of `table`, ALGORITHM_PARAMS by
        default) within its bound."""
        accepted = (ALGORITHM_PARAMS if table is None else table)[algorithm]
        for param, value in getattr(self, name).items():
            key = f"{self.key(name)}.{param}"
            if param not in accepted:
                raise ConfigError(f"{key}: algorithm {algorithm!r} has no parameter {param!r} "
                                  f"(accepted: {', '.join(accepted) or 'none'})")
            if not accepted[param].accepts(value):
                raise ConfigError(f"{key} must be {accepted[param]} for {algorithm}, got {value!r}")
