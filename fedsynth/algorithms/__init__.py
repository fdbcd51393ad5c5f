"""Federated algorithms behind a registry: `get_algorithm("fedavg" | "fedprox" | "scaffold" | "moon" | "sdafl" | "fedmix" |
"naivemix" | "fedgen" | "ddpm" | "pe", **params)`."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedsynth.algorithms.base import Aggregator, Algorithm, ClientUpdate, StateDict, snapshot_state
from fedsynth.algorithms.ddpm import FedDdpm
from fedsynth.algorithms.evolution import PrivateEvolution
from fedsynth.algorithms.fedavg import FedAvg
from fedsynth.algorithms.fedgen import FedGen
from fedsynth.algorithms.fedmix import FedMix, NaiveMix
from fedsynth.algorithms.fedprox import FedProx
from fedsynth.algorithms.moon import Moon
from fedsynth.algorithms.scaffold import Scaffold
from fedsynth.algorithms.sdafl import Sdafl
from fedsynth.config_schema import ALGORITHM_PARAMS, require_names
from fedsynth.config_schema import ALGORITHMS as NAMES
from fedsynth.errors import ConfigError

# By the names and parameters fedsynth.config_schema defines (the config check reads them there, without torch).
ALGORITHMS: dict[str, type] = {cls.name: cls for cls in (FedAvg, FedProx, Scaffold, Moon, Sdafl, FedMix, NaiveMix, FedGen, FedDdpm, PrivateEvolution)}
require_names("fedsynth.algorithms.ALGORITHMS", ALGORITHMS, NAMES)
for _name, _cls in ALGORITHMS.items():
    _fields = [f.name for f in dataclasses.fields(_cls) if not f.metadata.get("from_config")]  # ddpm's: the run config's
    require_names(f"{_cls.__name__}'s fields", _fields, tuple(ALGORITHM_PARAMS[_name]))

__all__ = ["ALGORITHMS", "Aggregator", "Algorithm", "ClientUpdate", "StateDict", "get_algorithm", "snapshot_state"]


def get_algorithm(name: str, **params: Any) -> Algorithm:
    """The algorithm `name` with its parameters (fedprox: mu; scaffold: num_clients (required), global_lr;
    moon: mu, temperature; fedmix, naivemix: mean_batch, lam;
    fedgen: alpha, beta, decay, gen_steps, gen_batch_size, gen_lr; ddpm: the run config's [federate] section and
    sizes, given by fedsynth.assembly). Unknown names, unknown or missing parameters and bad values raise ConfigError."""
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; expected one of {', '.join(ALGORITHMS)}")
    cls = ALGORITHMS[name]
    fields = dataclasses.fields(cls)
    accepted = {field.name for field in fields}
    unknown = sorted(set(params) - accepted)
    if unknown:
        allowed = ", ".join(sorted(accepted)) or "none"
        raise ConfigError(f"algorithm {name!r} has no parameter {unknown[0]!r} (accepted: {allowed})")
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in params]
    if required:
        raise ConfigError(f"algorithm {name!r} needs parameter {required[0]!r}")
    algorithm: Algorithm = cls(**params)
    return algorithm
