"""Prometheus metrics of a client-node process (summed over the logical clients it hosts)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fedsynth.process.metrics import DURATION_BUCKETS


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.train_seconds = Histogram(
            "fedsynth_client_local_training_seconds", "Wall-clock of one local update", buckets=DURATION_BUCKETS, **kw
        )
        self.samples_per_second = Gauge("fedsynth_client_training_samples_per_second", "Throughput of the last local update", **kw)
        self.rounds = Counter("fedsynth_client_rounds_total", "Local updates submitted", **kw)
        self.bytes_sent = Counter("fedsynth_client_sent_bytes_total", "Update payload bytes sent", **kw)
        self.bytes_received = Counter("fedsynth_client_received_bytes_total", "Model payload bytes received", **kw)
        self.images_requested = Counter("fedsynth_client_images_requested_total", "Synthetic images asked of the generator", **kw)
        self.images_received = Counter("fedsynth_client_images_received_total", "Synthetic images received and cached", **kw)
        self.images_held = Gauge("fedsynth_client_synthetic_images", "Synthetic images in the training sets of this process", **kw)
        self.generation_seconds = Histogram(
            "fedsynth_client_generation_seconds", "Wall-clock of one client's generation phase", buckets=DURATION_BUCKETS, **kw
        )
        self.cache_hits = Counter("fedsynth_client_cache_hits_total", "Generation phases served entirely from the cache", **kw)
        self.reconnects = Counter("fedsynth_client_reconnects_total", "Times a client re-registered after losing the coordinator", **kw)
