"""The run configuration: frozen, validated dataclasses read from TOML, with `section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedsynth.errors import ConfigError

POLICIES = ("none", "fedeas", "uniform", "missing", "full")
ALGORITHMS = ("fedavg", "fedprox", "scaffold", "moon", "sdafl")
GENERATOR_BACKENDS = ("ddpm", "holdout")  # generator_service.backends.BACKENDS; holdout: real held-out images


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    clients: int = 10
    partition: str = "dirichlet"
    alpha: float = 0.1
    min_size: int = 10
    holdout_fraction: float = 0.0

    def __post_init__(self) -> None:
        _require(self.clients >= 1, f"data.clients must be >= 1, got {self.clients}")
        _require(self.partition in ("dirichlet", "iid"), f"data.partition must be 'dirichlet' or 'iid', got {self.partition!r}")
        _require(self.alpha > 0, f"data.alpha must be > 0, got {self.alpha}")
        _require(self.min_size >= 0, f"data.min_size must be >= 0, got {self.min_size}")
        _require(0 <= self.holdout_fraction < 1, f"data.holdout_fraction must be in [0, 1), got {self.holdout_fraction}")


@dataclass(frozen=True)
class TrainConfig:
    model: str = "cnn"
    algorithm: str = "fedavg"
    rounds: int = 20
    fraction: float = 1.0
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    local_epochs: int = 5
    max_steps: int | None = None
    augment: bool = False
    eval_batch_size: int = 512
    algorithm_params: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.algorithm in ALGORITHMS, f"train.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        _require(self.rounds >= 1, f"train.rounds must be >= 1, got {self.rounds}")
        _require(0 < self.fraction <= 1, f"train.fraction must be in (0, 1], got {self.fraction}")
        _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _require(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        _require(self.local_epochs >= 1, f"train.local_epochs must be >= 1, got {self.local_epochs}")
        _require(self.max_steps is None or self.max_steps >= 0, f"train.max_steps must be >= 0, got {self.max_steps}")


@dataclass(frozen=True)
class GenerationConfig:
    policy: str = "fedeas"  # the embedded default run is FedEAS; "none" is plain federated training
    beta: float = 12.0
    budget: int | None = None
    backend: str = "ddpm"
    model_dir: str | None = None
    generator: str | None = None  # host:port of a running generator; None lets the launcher start one
    ddim_steps: int = 10
    guidance: float = 1.0  # w of classifier-free guidance; docs/generator.md: w = 3 collapses the tiny digits model
    train_steps: int = 1500  # for a generator the launcher trains on first use
    size: str = "tiny"

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, f"generation.policy must be one of {POLICIES}, got {self.policy!r}")
        _require(self.backend in GENERATOR_BACKENDS,
                 f"generation.backend must be one of {GENERATOR_BACKENDS}, got {self.backend!r}")
        _require(self.beta > 0, f"generation.beta must be > 0, got {self.beta}")
        _require(self.budget is None or self.budget >= 0, f"generation.budget must be >= 0, got {self.budget}")
        _require(self.ddim_steps >= 1, f"generation.ddim_steps must be >= 1, got {self.ddim_steps}")


@dataclass(frozen=True)
class SdaflConfig:
    """SDA-FL knobs. The paper does not publish tau, lambda2, a, the GAN sizes or epsilon: these are our defaults."""

    samples_per_client: int = 200  # M: unlabelled DP-GAN samples each client uploads once
    tau: float = 0.95  # keep a pseudo-label only where the max class probability exceeds tau
    lambda2: float = 1.0  # weight of the cross-entropy on the real batch
    mixup_alpha: float = 1.0  # lambda ~ Beta(a, a)
    gan_steps: int = 100  # generator iterations of each client's WGAN-GP
    gan_batch_size: int = 32  # expected (Poisson) real batch size of the critic
    gan_latent_dim: int = 32
    gan_width: int = 32
    gan_lr: float = 1e-4  # Adam (0.5, 0.9) as in WGAN-GP; 1e-3 trains far faster for tiny CPU-sized GANs
    secure_noise: bool = False  # True: unpredictable DP noise (Opacus secure_mode); runs stop being reproducible
    target_epsilon: float = 10.0  # 0: no target, use noise_multiplier as given
    noise_multiplier: float = 1.0
    delta: float = 0.0  # 0: 1 / N_k^1.1 for each client
    max_grad_norm: float = 1.0
    accountant: str = "rdp"
    server_steps: int = 20  # global-model steps on the labelled synthetic set after each aggregation
    server_lr: float = 0.01
    server_batch_size: int = 64
    track_agreement: bool = True  # measure pseudo-label agreement with a centrally trained reference classifier

    def __post_init__(self) -> None:
        _require(self.samples_per_client >= 1, f"sdafl.samples_per_client must be >= 1, got {self.samples_per_client}")
        _require(0 <= self.tau < 1, f"sdafl.tau must be in [0, 1), got {self.tau}")
        _require(self.lambda2 >= 0, f"sdafl.lambda2 must be >= 0, got {self.lambda2}")
        _require(self.mixup_alpha > 0, f"sdafl.mixup_alpha must be > 0, got {self.mixup_alpha}")
        _require(self.gan_steps >= 1, f"sdafl.gan_steps must be >= 1, got {self.gan_steps}")
        _require(self.gan_lr > 0, f"sdafl.gan_lr must be > 0, got {self.gan_lr}")
        _require(self.target_epsilon >= 0, f"sdafl.target_epsilon must be >= 0 (0: use noise_multiplier), got {self.target_epsilon}")
        _require(self.noise_multiplier >= 0, f"sdafl.noise_multiplier must be >= 0, got {self.noise_multiplier}")
        _require(0 <= self.delta < 1, f"sdafl.delta must be in [0, 1) (0: 1/N_k^1.1), got {self.delta}")
        _require(self.max_grad_norm > 0, f"sdafl.max_grad_norm must be > 0, got {self.max_grad_norm}")
        _require(self.accountant in ("rdp", "prv"), f"sdafl.accountant must be 'rdp' or 'prv', got {self.accountant!r}")
        _require(self.server_steps >= 0, f"sdafl.server_steps must be >= 0, got {self.server_steps}")


@dataclass(frozen=True)
class RuntimeConfig:
    host: str = "127.0.0.1"
    coordinator_port: int = 0
    round_timeout_s: float = 600.0
    quorum: float = 0.5
    registration_timeout_s: float = 300.0
    rejoin_grace_s: float = 10.0
    clients_per_process: int = 1
    torch_threads: int = 1
    heartbeat_s: float = 2.0
    tls_dir: str | None = None  # `fedsynth deploy provision` folder: the launcher runs every role over mutual TLS

    def __post_init__(self) -> None:
        _require(self.round_timeout_s > 0, f"runtime.round_timeout_s must be > 0, got {self.round_timeout_s}")
        _require(0 < self.quorum <= 1, f"runtime.quorum must be in (0, 1], got {self.quorum}")
        _require(self.registration_timeout_s > 0, f"runtime.registration_timeout_s must be > 0, got {self.registration_timeout_s}")
        _require(self.clients_per_process >= 1, f"runtime.clients_per_process must be >= 1, got {self.clients_per_process}")
        _require(self.torch_threads >= 1, f"runtime.torch_threads must be >= 1, got {self.torch_threads}")
        _require(self.heartbeat_s > 0, f"runtime.heartbeat_s must be > 0, got {self.heartbeat_s}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    seed: int = 0
    out_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sdafl: SdaflConfig = field(default_factory=SdaflConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that changes results; a checkpoint resumes only on a match. Where output goes, the
        runtime settings and the number of rounds are left out, so a finished run can be extended."""
        content = self.to_dict()
        content.pop("out_dir")
        content.pop("runtime")
        content["train"].pop("rounds")
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS = {
    "data": DataConfig,
    "train": TrainConfig,
    "generation": GenerationConfig,
    "runtime": RuntimeConfig,
    "sdafl": SdaflConfig,
}


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    _require(not unknown, f"unknown key(s) in [{where}]: {', '.join(unknown)}; known: {', '.join(known)}")
    defaults = cls()
    converted: dict[str, Any] = {}
    for key, value in values.items():
        expected = getattr(defaults, key)
        if isinstance(expected, bool) and not isinstance(value, bool):
            raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
        if isinstance(expected, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected is not None and not isinstance(expected, dict) and not isinstance(value, type(expected)):
            raise ConfigError(f"{where}.{key} must be {type(expected).__name__}, got {value!r}")
        converted[key] = value
    try:
        return cls(**converted)
    except TypeError as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc


def from_dict(raw: dict[str, Any]) -> RunConfig:
    top = {k: v for k, v in raw.items() if k not in SECTIONS}
    sections = {name: _build(cls, raw.get(name, {}) or {}, name) for name, cls in SECTIONS.items()}
    for name in SECTIONS:
        if name in raw and not isinstance(raw[name], dict):
            raise ConfigError(f"[{name}] must be a table, got {raw[name]!r}")
    base = _build(RunConfig, top, "top level")
    return dataclasses.replace(base, **sections)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as fedeas or a path


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` (or `key=value` at the top level); the value is read as TOML, else a string."""
    merged = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        _require(bool(sep) and bool(key), f"--set expects key=value, got {item!r}")
        *path, leaf = key.strip().split(".")
        node = merged
        for part in path:
            node = node.setdefault(part, {})
            _require(isinstance(node, dict), f"--set {item!r}: {part!r} is not a section")
        node[leaf] = _parse_value(value.strip())
    return merged


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        _require(p.is_file(), f"config file {str(path)!r} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    return from_dict(apply_overrides(raw, overrides or []))


def to_json(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def from_json(text: str) -> RunConfig:
    return from_dict(json.loads(text))
