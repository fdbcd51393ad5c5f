"""Prometheus metrics of the generator service, in a registry of its own choosing (tests use one per server)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

from fedsynth.generation.generator_names import (
    DEVICE_SECONDS_TOTAL,
    FILTER_ACCEPTED_TOTAL,
    FILTER_CANDIDATES_TOTAL,
    FILTER_JUDGE_SECONDS_TOTAL,
    FILTER_MIN_CONFIDENCE,
    FILTER_UNSERVED_DEVICE_SECONDS_TOTAL,
    FILTER_REJECTED_TOTAL,
    IMAGES_TOTAL,
    INFO,
    REQUESTS_TOTAL,
)
from fedsynth.process.metrics import DURATION_BUCKETS, SIZE_BUCKETS, MetricsHTTPServer, serve_metrics
from fedsynth.wire.tls import RevocationList, TLSFiles

# Images per request reach the tens of thousands (a client's whole synthetic budget in one call).
REQUEST_IMAGE_BUCKETS = SIZE_BUCKETS + (16384, 65536)


class GeneratorMetrics:
    """Requests are counted apart from images; latencies are histograms; labels stay low-cardinality."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        r = self.registry
        self.requests = Counter(REQUESTS_TOTAL, "RPCs answered, by method and status code",
                                ["method", "code"], registry=r)
        self.images = Counter(IMAGES_TOTAL, "Images sent to clients, by class", ["class_id"], registry=r)
        self.request_images = Histogram("fedsynth_generator_request_images", "Images asked for per accepted request",
                                        buckets=REQUEST_IMAGE_BUCKETS, registry=r)
        self.batch_size = Histogram("fedsynth_generator_batch_size", "Real (unpadded) images per sampling batch",
                                    buckets=SIZE_BUCKETS, registry=r)
        self.request_duration = Histogram("fedsynth_generator_request_duration_seconds", "Wall time of accepted Generate RPCs",
                                          buckets=DURATION_BUCKETS, registry=r)
        self.queue_wait = Histogram("fedsynth_generator_queue_wait_seconds",
                                    "Time from a request's arrival until its first image starts sampling",
                                    buckets=DURATION_BUCKETS, registry=r)
        self.device_seconds = Counter(DEVICE_SECONDS_TOTAL, "Time spent sampling on the device (with the quality "
                                      "filter: every candidate, rejected ones too, and the judge)", registry=r)
        self.filter_min_confidence = Gauge(FILTER_MIN_CONFIDENCE, "The quality filter's threshold; 0 = off", registry=r)
        self.filter_candidates = Counter(FILTER_CANDIDATES_TOTAL, "Candidates the quality filter drew (accepted + rejected "
                                         "+ spare), by class",
                                         ["class_id"], registry=r)
        self.filter_accepted = Counter(FILTER_ACCEPTED_TOTAL, "Candidates the judge accepted, by class",
                                       ["class_id"], registry=r)
        self.filter_rejected = Counter(FILTER_REJECTED_TOTAL, "Candidates the judge rejected, by class",
                                       ["class_id"], registry=r)
        self.filter_unserved_device_seconds = Counter(FILTER_UNSERVED_DEVICE_SECONDS_TOTAL,
                                                      "Sampling time of candidates not served (rejected, or drawn "
                                                      "in spare rows and not needed)", registry=r)
        self.filter_judge_seconds = Counter(FILTER_JUDGE_SECONDS_TOTAL, "Time the judge spent scoring candidates",
                                            registry=r)
        self.queued_images = Gauge("fedsynth_generator_queued_images", "Images waiting to be sampled", registry=r)
        self.model_load_seconds = Gauge("fedsynth_generator_model_load_seconds", "Time it took to load the model",
                                        registry=r)
        self.info = Info(INFO.removesuffix("_info"), "The served model", registry=r)


def serve_registry(port: int, registry: CollectorRegistry, host: str = "127.0.0.1", tls: TLSFiles | None = None,
                   revoked: RevocationList | None = None) -> MetricsHTTPServer | None:
    """fedsynth.process.metrics.serve_metrics for a given registry (HTTPS when `tls` is given); stoppable (.shutdown()); port < 0: none."""
    return serve_metrics(port, host, tls=tls, revoked=revoked, registry=registry)
