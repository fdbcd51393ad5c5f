"""Build what a run config names (algorithm, local-training settings, a client's shard), identically in every process."""

from __future__ import annotations

import functools
import threading
import zlib

import numpy as np
import torch
from torch import nn

from fedsynth.algorithms import Algorithm, get_algorithm
from fedsynth.algorithms.privacy import noise_multiplier_for
from fedsynth.algorithms.user_dp import UserLevelDp
from fedsynth.config import DataConfig, RunConfig
from fedsynth.learning.data import ArrayDataset, load_dataset
from fedsynth.learning.evaluation import DEFAULT_LOCAL_TEST_FRACTION, held_out_indices
from fedsynth.errors import ConfigError, FedsynthError
from fedsynth.learning.models import ProjectedModel, build_model, has_features_head
from fedsynth.learning.partition import partition_for
from fedsynth.learning.hardware import node_device, resolve_hardware
from fedsynth.learning.training import LocalTrainConfig

FLIP_DATASETS = frozenset({"cifar10", "cifar100"})  # horizontal flips keep a natural image's class, not a digit's


def clients_per_round(cfg: RunConfig) -> int:
    """m: the clients the coordinator samples each round (without replacement)."""
    return max(1, round(cfg.train.fraction * cfg.data.clients))


def user_dp_for(cfg: RunConfig, noise_secret: bytes = b"") -> UserLevelDp | None:
    """train.dp = "user": the run's DP-FedAvg, sigma picked for train.target_epsilon over train.rounds when
    train.noise_multiplier is unset (ConfigError naming train.target_epsilon when no sigma reaches it); else None."""
    t = cfg.train
    if t.dp != "user":
        return None
    m, k = clients_per_round(cfg), cfg.data.clients
    sigma = t.noise_multiplier
    if sigma is None:
        assert t.target_epsilon is not None  # TrainConfig.check
        sigma = noise_multiplier_for(target_epsilon=t.target_epsilon, delta=t.dp_delta, sample_rate=m / k, steps=t.rounds,
                                     accountant=t.dp_accountant, section="train")
    return UserLevelDp(clip=t.dp_clip, noise_multiplier=sigma, clients=k, clients_per_round=m, delta=t.dp_delta,
                       accountant=t.dp_accountant, budget=t.target_epsilon, seed=cfg.seed, noise_secret=noise_secret)


def algorithm_for(cfg: RunConfig) -> Algorithm:
    if cfg.train.algorithm == "ddpm":  # the federated generator: its settings are the [federate] section
        return get_algorithm("ddpm", settings=cfg.federate, size=cfg.train.model.removeprefix("unet-"), clients=cfg.data.clients,
                             clients_per_round=clients_per_round(cfg), rounds=cfg.train.rounds, seed=cfg.seed,
                             flip=cfg.data.dataset in FLIP_DATASETS)
    if cfg.train.algorithm == "pe":  # Private Evolution: its settings are the [evolve] section
        return get_algorithm("pe", settings=cfg.evolve, num_classes=_num_classes(cfg), clients=cfg.data.clients,
                             clients_per_round=clients_per_round(cfg), rounds=cfg.train.rounds, seed=cfg.seed)
    params = dict(cfg.train.algorithm_params)
    if cfg.train.algorithm == "scaffold":
        params.setdefault("num_clients", cfg.data.clients)
    if cfg.train.algorithm == "sdafl":
        params.setdefault("lambda2", cfg.sdafl.lambda2)
        params.setdefault("mixup_alpha", cfg.sdafl.mixup_alpha)
    return get_algorithm(cfg.train.algorithm, **params)


def _num_classes(cfg: RunConfig) -> int:
    """The run's classes, as every process can tell them: the label schema (local mode), else the dataset's."""
    from fedsynth.learning.data import NUM_CLASSES, load_labels, num_classes
    from fedsynth.learning.label_schema import schema_of

    schema = schema_of(cfg.data)
    if schema is not None:
        return len(schema.classes)
    if cfg.data.dataset in NUM_CLASSES:
        return NUM_CLASSES[cfg.data.dataset]
    return num_classes(cfg.data.dataset, load_labels(cfg.data.dataset, "train", data_dir=cfg.data.data_dir))


def model_for(cfg: RunConfig, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """The run's model: `train.model`, with MOON's projection head when the algorithm is MOON (projection_dim > 0).
    Weights come from torch's global RNG, as build_model's do."""
    if cfg.train.algorithm == "pe":
        from fedsynth.algorithms.evolution import VoteTally

        return VoteTally(num_classes * cfg.evolve.candidates_per_class)
    model = build_model(cfg.train.model, num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    projection_dim = getattr(algorithm_for(cfg), "projection_dim", 0) if cfg.train.algorithm == "moon" else 0
    _check_split_for(cfg, model, projection_dim)
    if projection_dim:
        model = ProjectedModel(model, num_classes=num_classes, projection_dim=projection_dim)
    return model


def _check_split_for(cfg: RunConfig, model: nn.Module, projection_dim: int) -> None:
    """MOON and FedGen call model.features(x) and model.head(rep) (MOON's projection head also reads
    representation_dim; FedGen's server finds the head's weights at "classifier." or "net.fc."): ConfigError naming
    train.model and train.algorithm when the built model lacks what they need (docs/guides/bring-your-own-model.md)."""
    algorithm = cfg.train.algorithm
    if algorithm not in ("moon", "fedgen"):
        return
    refused = f"train.algorithm={algorithm!r} cannot train train.model={cfg.train.model!r}"
    if not has_features_head(model):
        raise ConfigError(f"{refused}: it needs features(x) and head(rep) methods on the model's class, and this model "
                          "has none (see docs/guides/bring-your-own-model.md)")
    if projection_dim and not isinstance(getattr(model, "representation_dim", None), int):
        raise ConfigError(f"{refused}: MOON's projection head needs an integer model.representation_dim (the width of "
                          "features(x)); set one, or train.algorithm_params.projection_dim = 0")
    if algorithm == "fedgen":
        from fedsynth.algorithms.fedgen import HEAD_PREFIXES, head_prefix

        try:
            head_prefix(model.state_dict())
        except FedsynthError as exc:
            raise ConfigError(f"{refused}: FedGen's server needs the head's weight and bias under one of "
                              f"{', '.join(HEAD_PREFIXES)} in the state dict") from exc


def local_train_config(cfg: RunConfig, round_number: int = 1) -> LocalTrainConfig:
    """Local training as the run config says, for round `round_number` (its lr under train.lr_schedule), on the device
    this process trains on (`fedsynth client --device`, else train.device, resolved here: ConfigError on a process
    without that GPU, or fp16 without a GPU)."""
    t = cfg.train
    spec, key = node_device(t.device)
    device = resolve_hardware(spec, t.precision, key=key)
    return LocalTrainConfig(
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        batch_size=t.batch_size,
        local_epochs=t.local_epochs,
        augment=t.augment,
        max_steps=t.max_steps,
        optimizer=t.optimizer,
        lr_schedule=t.lr_schedule,
        rounds=t.rounds,
        round_number=round_number,
        device=str(device),
        precision=t.precision,
    )


def client_shard(cfg: RunConfig, client_id: int) -> ArrayDataset:
    """Client k's private shard, computed from (dataset, K, alpha, seed, k) alone; nodes on other machines agree."""
    train, parts = _partitioned(cfg.data, cfg.seed)
    return train.subset(parts[client_id])


def local_test_fraction(cfg: RunConfig) -> float:
    """The share of a shard held out for federated evaluation: data.local_test_fraction, or the documented default
    when the clients evaluate and it is left at 0; 0 under server-only evaluation unless it is set."""
    fraction = cfg.data.local_test_fraction
    if fraction == 0 and cfg.train.evaluation != "server":
        return DEFAULT_LOCAL_TEST_FRACTION
    return fraction


def local_test_split(cfg: RunConfig, client_id: int, shard: ArrayDataset, *,
                     own_test: ArrayDataset | None = None) -> tuple[ArrayDataset, ArrayDataset | None]:
    """(what client k trains on, its local test set or None): the one place that chooses a client's test examples.
    Under federated evaluation a client with a test folder of its own (`own_test`, local mode) tests on it and trains
    on its whole shard, unless data.local_test_fraction is set; otherwise the seeded held-out part of its shard. At a
    fraction of 0 (server-only evaluation) the shard is returned as it is: training data bit for bit as without
    federated evaluation."""
    fraction = local_test_fraction(cfg)
    if fraction == 0:
        return shard, None
    if own_test is not None and cfg.data.local_test_fraction == 0:
        return shard, own_test
    train, test = held_out_indices(len(shard.y), fraction, client_seed(cfg, client_id, "local-test") % (2**32))
    return shard.subset(train), shard.subset(test)


_split_lock = threading.Lock()


def _partitioned(d: DataConfig, seed: int) -> tuple[ArrayDataset, list[np.ndarray]]:
    """One load and one split per process for all its logical clients, which ask at once from their threads: the lock
    makes the others wait for the first instead of each redoing it (lru_cache alone does not), and a failure is kept."""
    with _split_lock:
        outcome = _load_and_split(d, seed)
    if isinstance(outcome, FedsynthError):
        raise type(outcome)(str(outcome))  # a fresh exception per client thread, not one shared traceback
    return outcome


@functools.lru_cache(maxsize=2)
def _load_and_split(d: DataConfig, seed: int) -> tuple[ArrayDataset, list[np.ndarray]] | FedsynthError:
    try:
        train = load_dataset(d.dataset, "train", data_dir=d.data_dir, download=d.download)
        return train, partition_for(d, seed, train.y)
    except FedsynthError as exc:
        return exc


def client_seed(cfg: RunConfig, client_id: int, purpose: str) -> int:
    """A 63-bit seed for one client and purpose (training order, generation), fixed by the run seed."""
    return (cfg.seed * 1_000_003 + client_id * 7919 + zlib.crc32(purpose.encode())) & ((1 << 63) - 1)


def round_generator(cfg: RunConfig, client_id: int, round_number: int) -> torch.Generator:
    return torch.Generator().manual_seed(client_seed(cfg, client_id, f"train-round-{round_number}"))
