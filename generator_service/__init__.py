"""The generator process: class-conditional DDPM served over gRPC, generator training, and the DP-GAN used by SDA-FL.

Public entry points (the rest is internal): `create_server(ServeConfig(...))` serves a backend in this process, as
`fedsynth generator serve` does; `fedsynth generator train` writes a model folder. They load lazily, so importing
one submodule (the DP-GAN, say) does not load the serving stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fedsynth.wire.tls import ServerSecurity
    from generator_service.serve_cmd import GeneratorServer, ServeConfig

__all__ = ["GeneratorServer", "ServeConfig", "create_server"]


def create_server(
    config: ServeConfig, *, registry: CollectorRegistry | None = None, security: ServerSecurity | None = None
) -> GeneratorServer:
    """A generator server: start() binds (health NOT_SERVING), load() loads the backend, stop(grace) ends it.

    `registry` holds its metrics (default: the process-wide one); `security` defaults to plaintext.
    """
    from generator_service.serve_cmd import GeneratorServer

    return GeneratorServer(config, registry=registry, security=security)


def __getattr__(name: str) -> Any:
    if name in ("GeneratorServer", "ServeConfig"):
        from generator_service import serve_cmd

        return getattr(serve_cmd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
