"""The generator process: class-conditional DDPM served over gRPC, generator training, and the DP-GAN used by SDA-FL.

Public entry points (the rest is internal): `create_server(ServeConfig(...))` serves a backend in this process, as
`fedsynth generator serve` does; `fedsynth generator train` writes a model folder; `load_judge(dataset)` is the cached
classifier `fedsynth generator evaluate` scores with. They load lazily, so importing
one submodule (the DP-GAN, say) does not load the serving stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fedsynth.wire.tls import ServerSecurity
    from generator_service.evaluation.judge import Judge
    from generator_service.serve_cmd import GeneratorServer, ServeConfig

__all__ = ["GeneratorServer", "ServeConfig", "create_server", "load_judge"]


def create_server(
    config: ServeConfig, *, registry: CollectorRegistry | None = None, security: ServerSecurity | None = None
) -> GeneratorServer:
    """A generator server: start() binds (health NOT_SERVING), load() loads the backend, stop(grace) ends it.

    `registry` holds its metrics (default: the process-wide one); `security` defaults to plaintext.
    """
    from generator_service.serve_cmd import GeneratorServer

    return GeneratorServer(config, registry=registry, security=security)


def load_judge(dataset: str, *, data_dir: Path | None = None, seed: int = 0, cache: Path | None = None) -> Judge:
    """`fedsynth generator evaluate`'s default judge for `dataset` (its CPU recipe, `seed`), from the judge cache
    (default $FEDSYNTH_CACHE/judges), trained and cached when absent. `judge.score(uint8 N x H x W x C)` gives
    (features, class probabilities)."""
    from generator_service.evaluation.judge import load_or_train_judge

    return load_or_train_judge(dataset, data_dir=data_dir, seed=seed, root=cache)


def __getattr__(name: str) -> Any:
    if name in ("GeneratorServer", "ServeConfig"):
        from generator_service import serve_cmd

        return getattr(serve_cmd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
