"""The images to score: from a served generator (gRPC), from a backend started in this process, or from a .npz file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from fedsynth.wire import grpcutil
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from fedsynth.learning.image_arrays import checked_image_arrays

INFO_TIMEOUT_S = 60.0  # a generator still loading answers UNAVAILABLE meanwhile


@dataclass(frozen=True)
class GeneratedImages:
    images: np.ndarray  # uint8 N x H x W x C, in class order
    labels: np.ndarray  # int64 N
    backend: str
    model_id: str
    dataset: str  # what the generator says it was made from; "" when unknown (a file)
    num_classes: int
    seconds: float  # wall time to get the images


def from_channel(channel: grpc.Channel, *, per_class: int, seed: int, timeout_s: float) -> GeneratedImages:
    """per_class images of every class the generator serves, requested with `seed` (so the same images every time)."""
    started = time.perf_counter()
    info = GeneratorInfo.fetch(channel, timeout_s=INFO_TIMEOUT_S)
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []

    def on_batch(batch_labels: np.ndarray, batch: np.ndarray, _first: int) -> None:
        labels.append(batch_labels.copy())
        images.append(batch.copy())

    fetch_images(channel, [per_class] * info.num_classes, seed=seed, model_id=info.model_id, timeout_s=timeout_s,
                 on_batch=on_batch)
    return GeneratedImages(np.concatenate(images), np.concatenate(labels), info.backend, info.model_id, info.dataset,
                           info.num_classes, time.perf_counter() - started)


def from_address(address: str, credentials: grpc.ChannelCredentials | None, *, per_class: int, seed: int,
                 timeout_s: float) -> GeneratedImages:
    """As from_channel; a refused or unreachable generator is a ConfigError naming the address, status and reason."""
    channel = grpcutil.make_channel(address, credentials)
    try:
        return from_channel(channel, per_class=per_class, seed=seed, timeout_s=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "error"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        raise ConfigError(f"the generator at {address} answered {code}: {details}") from exc
    finally:
        channel.close()


def from_backend(config: object, *, per_class: int, seed: int, timeout_s: float) -> GeneratedImages:
    """Start `fedsynth generator serve`'s server in this process on a free loopback port (plaintext, no metrics
    endpoint), fetch through it exactly as a client would, and stop it."""
    from generator_service import ServeConfig, create_server

    assert isinstance(config, ServeConfig)
    server = create_server(config, registry=CollectorRegistry())
    port = server.start()
    try:
        server.load()
        return from_address(f"127.0.0.1:{port}", None, per_class=per_class, seed=seed, timeout_s=timeout_s)
    finally:
        server.stop(grace_s=0)


def from_npz(path: Path, *, per_class: int | None) -> GeneratedImages:
    """Images `x` (uint8 N x H x W x C, or N x H x W) and labels `y`; per_class: the first that many of each class."""
    started = time.perf_counter()
    if not path.is_file():
        raise ConfigError(f"--images {str(path)!r} does not exist or is not a file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "x" not in archive.files or "y" not in archive.files:
                raise ConfigError(f"--images {path}: expected arrays 'x' and 'y', found {archive.files}")
            x, y = np.asarray(archive["x"]), np.asarray(archive["y"])
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--images {path}: not a readable .npz file ({exc})") from exc
    x, y = checked_image_arrays(x, y, f"--images {path}", ConfigError)
    y = y.astype(np.int64)
    if len(y) == 0 or y.min() < 0:
        raise ConfigError(f"--images {path}: labels must be integers >= 0, got {len(y)} labels")
    num_classes = int(y.max()) + 1
    order = np.argsort(y, kind="stable")
    if per_class is not None:
        order = np.concatenate([order[y[order] == c][:per_class] for c in range(num_classes)])
    return GeneratedImages(x[order], y[order], "images", f"file:{path.name}", "", num_classes, time.perf_counter() - started)
