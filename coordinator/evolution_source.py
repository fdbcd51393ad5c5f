"""Private Evolution's public generator as the coordinator reaches it: random images by class counts (Generate) and
variations of given images (Vary), from the generator service at `--generator`, pinned to the model it served first."""

from __future__ import annotations

import logging

import grpc
import numpy as np

from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images, vary_images
from fedsynth.wire import grpcutil

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 60.0  # within the launcher's wait for the coordinator's port (the generator is SERVING by then)


class GeneratorSource:
    """fedsynth.algorithms.evolution.CandidateSource over gRPC; every call's deadline is `timeout_s`."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None, *, num_classes: int,
                 image_shape: tuple[int, int, int], timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpcutil.make_channel(address, credentials)
        try:  # a generator still loading answers UNAVAILABLE, and so does a TLS handshake that fails: wait, not forever
            self.info = GeneratorInfo.fetch(self.channel, timeout_s=min(timeout_s, CONNECT_TIMEOUT_S))
        except grpc.RpcError as exc:
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise ConfigError(f"the public generator at {address} did not answer Info within "
                              f"{min(timeout_s, CONNECT_TIMEOUT_S):.0f}s ({detail}); is it serving there, and does its "
                              "certificate trust this coordinator's (a coordinator certificate needs clientAuth: "
                              "`fedsynth deploy provision` gives it since 2026-12-07)?") from None
        if self.info.num_classes != num_classes or self.info.image_shape != image_shape:
            raise ConfigError(f"the public generator at {address} serves {self.info.num_classes} classes of "
                              f"{self.info.image_shape} images; this run's clients hold {num_classes} classes of {image_shape}")
        if self.info.backend == "holdout":
            raise ConfigError(f"the generator at {address} serves real held-out images (backend holdout): Private "
                              "Evolution needs a public generative model")
        self.channel_shape = (image_shape[1], image_shape[2], image_shape[0])  # H, W, C as the wire carries images
        log.info("public generator at %s: %s (%s, %d parameters)", address, self.info.model_id, self.info.backend, self.info.parameters)

    def random(self, per_class: int, num_classes: int, seed: int) -> np.ndarray:
        out = np.empty((per_class * num_classes, *self.channel_shape), dtype=np.uint8)
        step = max(1, self.info.max_request_images)
        for c in range(num_classes):
            for start in range(0, per_class, step):
                count = min(step, per_class - start)
                counts, offsets = [0] * num_classes, [0] * num_classes
                counts[c], offsets[c] = count, start
                row = c * per_class + start

                def keep(labels: np.ndarray, images: np.ndarray, first: int, row: int = row) -> None:
                    out[row + first : row + first + len(images)] = images

                fetch_images(self.channel, counts, seed=seed, offsets=offsets, model_id=self.info.model_id,
                             timeout_s=self.timeout_s, on_batch=keep)
        return out

    def vary(self, images: np.ndarray, labels: np.ndarray, strength: float, seed: int) -> np.ndarray:
        out = np.empty_like(images)
        step = max(1, self.info.max_request_images)
        for start in range(0, len(images), step):
            part = slice(start, start + step)
            out[part] = vary_images(self.channel, images[part], labels[part], strength=strength, seed=seed,
                                    first_index=start, model_id=self.info.model_id, timeout_s=self.timeout_s)
        return out

    def close(self) -> None:
        self.channel.close()
