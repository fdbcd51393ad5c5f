"""The client side of FedEAS (Algorithm 1): decide this client's images per class, then fill the cache once."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from client_node.metrics import ClientMetrics
from client_node.synthetic_cache import SyntheticCache
from fedsynth.allocation import client_quota
from fedsynth.assembly import client_seed
from fedsynth.config import RunConfig
from fedsynth.errors import ConfigError, DataError, WireError
from fedsynth.wire.server_check import check_servers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyntheticSet:
    x: np.ndarray
    y: np.ndarray
    cache_hit: bool

    @property
    def count(self) -> int:
        return len(self.y)


def planned_quota(cfg: RunConfig, counts: np.ndarray, assigned: list[int], *, policy: str | None = None) -> np.ndarray:
    """Images per class: computed from this client's own counts (fedeas, full) or assigned (uniform, missing), under
    the run's FedEAS rule (generation.beta, exponent, entropy_factor). `policy` overrides the run's."""
    g = cfg.generation
    try:
        return client_quota(policy or g.policy, counts, beta=g.beta, assigned=assigned, exponent=g.exponent,
                            entropy_factor=g.entropy_factor)
    except DataError as exc:
        raise WireError(f"the coordinator's quota does not fit this client: {exc}") from exc


def fedeas_total(cfg: RunConfig, counts: np.ndarray) -> int:
    """The FedEAS images this client would generate (reported at registration: uniform / missing are matched to the
    sum); 0 when the run generates nothing."""
    return 0 if cfg.generation.policy == "none" else int(planned_quota(cfg, counts, [], policy="fedeas").sum())


def synthesize(
    cfg: RunConfig,
    client_id: int,
    real_y: np.ndarray,
    num_classes: int,
    assigned: list[int],
    options,
    metrics: ClientMetrics,
    stop: threading.Event | None = None,
    real_shape: tuple[int, int, int] | None = None,
) -> SyntheticSet:
    """This client's synthetic images for the round's quota; `real_shape` (channels, height, width) of its real images
    is what the generator's must be."""
    counts = np.bincount(real_y, minlength=num_classes)
    quota = planned_quota(cfg, counts, assigned)
    if quota.sum() == 0:
        return SyntheticSet(np.zeros((0, 1, 1, 1), np.uint8), np.zeros(0, np.int64), False)
    if options.generator is None:
        raise ConfigError(f"policy {cfg.generation.policy!r} needs a generator service (--generator HOST:PORT)")
    from fedsynth.generation.generator_replicas import GeneratorReplicas

    replicas = GeneratorReplicas.connect(options.generator, options.credentials, key="--generator")  # 1 or more
    try:
        info = replicas.info(timeout_s=60.0)
        if options.revoked is not None and options.tls_files is not None:
            for address in replicas.addresses:
                check_servers(address, options.tls_files, options.revoked, what="generator", timeout_s=60.0)
        if info.num_classes != num_classes:
            raise ConfigError(f"the generator at {options.generator} serves {info.num_classes} classes; this run has {num_classes}")
        if real_shape is not None and tuple(info.image_shape) != real_shape:
            made, mine = ("x".join(map(str, shape)) for shape in (info.image_shape, real_shape))
            raise ConfigError(f"the generator at {options.generator} makes {made} images; this client's are {mine} "
                              "(data.channels x data.image_size): FedEAS at this size needs a generator trained at it "
                              "(docs/generator.md)")
        seed = client_seed(cfg, client_id, "generation")
        identity = {"model_id": info.model_id, "seed": seed, "image_shape": list(info.image_shape)}
        cache = SyntheticCache(options.cache_dir / f"client-{client_id:04d}", identity=identity, num_classes=num_classes)
        missing = np.maximum(quota - cache.have, 0)
        if missing.sum() > 0:
            started = time.monotonic()
            metrics.images_requested.inc(int(missing.sum()))

            def on_batch(labels: np.ndarray, images: np.ndarray, _first: int) -> None:
                for class_id in np.unique(labels):  # a batch may span the end of one class and the start of the next
                    rows = labels == class_id
                    cache.append(int(class_id), int(cache.have[class_id]), images[rows])
                metrics.images_received.inc(len(images))

            replicas.fetch(
                missing.tolist(), seed=seed, offsets=cache.have.tolist(), model_id=info.model_id,
                on_batch=on_batch, timeout_s=cfg.runtime.round_timeout_s, stop=stop,
            )
            metrics.generation_seconds.observe(time.monotonic() - started)
            log.info("client %d: generated %d images in %.1fs", client_id, int(missing.sum()), time.monotonic() - started)
        else:
            metrics.cache_hits.inc()
            log.info("client %d: all %d synthetic images from the cache", client_id, int(quota.sum()))
        x, y = cache.images(quota)
    finally:
        replicas.close()
    return SyntheticSet(x, y, cache_hit=bool(missing.sum() == 0))
