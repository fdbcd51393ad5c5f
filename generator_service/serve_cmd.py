"""`fedsynth generator serve`: the generator process: load a model folder and serve it over gRPC."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from fedsynth import grpcutil, tls
from fedsynth.errors import ConfigError
from fedsynth.runtime import write_atomic
from fedsynth.v1 import generator_pb2_grpc
from generator_service.batcher import Batcher
from generator_service.ddpm.model import load_generator, read_metadata
from generator_service.ddpm.sampling import DdimSampler, SamplingConfig, resolve_device
from generator_service.metrics import GeneratorMetrics, serve_registry
from generator_service.servicer import GeneratorServicer, ServedModel

log = logging.getLogger(__name__)
SERVICE_NAME = "fedsynth.v1.Generator"


@dataclass(frozen=True)
class ServeConfig:
    model: Path
    host: str = "127.0.0.1"
    port: int = 0
    port_file: Path | None = None
    metrics_port: int = 0
    max_batch: int = 64
    max_wait_ms: float = 20.0
    max_request_images: int = 100_000
    max_concurrent_rpcs: int = 64
    queue_limit: int = 200_000
    device: str = "auto"
    ddim_steps: int | None = None  # None: the folder's default
    guidance: float | None = None
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        for name in ("max_batch", "max_request_images", "max_concurrent_rpcs", "queue_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.ddim_steps is not None and not 1 <= self.ddim_steps <= 1000:
            raise ConfigError(f"--ddim-steps must be in 1..1000, got {self.ddim_steps}")
        if self.guidance is not None and not 0.0 <= self.guidance <= 100.0:
            raise ConfigError(f"--guidance must be in 0..100, got {self.guidance}")
        if self.threads < 0:
            raise ConfigError(f"--threads must be >= 0, got {self.threads}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if self.queue_limit < self.max_request_images:
            raise ConfigError(f"--queue-limit {self.queue_limit} is below --max-request-images {self.max_request_images}")


class GeneratorServer:
    """start() binds and serves health (NOT_SERVING); load() loads the model, then health says SERVING."""

    def __init__(self, config: ServeConfig, *, registry: CollectorRegistry | None = None,
                 security: tls.ServerSecurity | None = None) -> None:
        self.config = config
        self.security = security or tls.ServerSecurity(files=None)  # in-process default: plaintext, as before
        self.metrics = GeneratorMetrics(registry)
        self.server = grpcutil.make_server(max_workers=config.max_concurrent_rpcs + 8,
                                           max_concurrent_rpcs=config.max_concurrent_rpcs)
        self.health = grpcutil.add_health(self.server, SERVICE_NAME)
        self.servicer = GeneratorServicer(metrics=self.metrics, max_request_images=config.max_request_images)
        generator_pb2_grpc.add_GeneratorServicer_to_server(self.security.guard(self.servicer), self.server)
        self.batcher: Batcher | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_http: WSGIServer | None = None
        read_metadata(config.model)  # fail fast on a wrong folder, before binding anything

    def start(self) -> int:
        self.port = grpcutil.bind(self.server, f"{self.config.host}:{self.config.port}", self.security.credentials())
        self.server.start()
        self._metrics_http = serve_registry(self.config.metrics_port, self.metrics.registry)
        self.metrics_port = None if self._metrics_http is None else int(self._metrics_http.server_port)
        return self.port

    def load(self) -> ServedModel:
        started = time.perf_counter()
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        loaded = load_generator(self.config.model)
        meta = loaded.metadata
        device = resolve_device(self.config.device)
        sampling = SamplingConfig(
            meta.ddim_steps if self.config.ddim_steps is None else self.config.ddim_steps,
            meta.guidance if self.config.guidance is None else self.config.guidance,
            self.config.max_batch,
        )
        sampler = DdimSampler(loaded.unet, loaded.scheduler_config, num_classes=meta.num_classes,
                              image_shape=meta.image_shape, config=sampling, device=device)
        self.batcher = Batcher(sampler.sample, max_batch=self.config.max_batch,
                               max_wait_s=self.config.max_wait_ms / 1000.0, queue_limit=self.config.queue_limit,
                               metrics=self.metrics)
        dtype = str(sampler.dtype).removeprefix("torch.")
        model = ServedModel(meta, self.batcher, device.type, dtype, sampling.steps, sampling.guidance)
        self.servicer.attach(model)
        self.metrics.model_load_seconds.set(time.perf_counter() - started)
        self.metrics.info.info({"backend": meta.backend, "size": meta.size, "model_id": meta.model_id,
                                "device": device.type, "dtype": dtype})
        grpcutil.set_serving(self.health, SERVICE_NAME)
        log.info("serving %s (%s, %d parameters) on %s, %s, %d DDIM steps, guidance %.2f", meta.model_id, meta.size,
                 meta.parameters, device.type, dtype, sampling.steps, sampling.guidance)
        return model

    def stop(self, grace_s: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.close()

    def close(self) -> None:
        """Release the batcher and the metrics endpoint (after the gRPC server has stopped)."""
        if self.batcher is not None:
            self.batcher.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig(model=Path("."))
    parser.add_argument("--model", type=Path, required=True, help="generator folder (from `fedsynth generator train`)")
    parser.add_argument("--host", default=d.host, help="address to listen on; 0.0.0.0 for other machines (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="gRPC port, 0 picks a free one (default %(default)s)")
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound gRPC port here (atomically)")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port,
                        help="Prometheus /metrics port, 0 picks a free one, -1 disables (default %(default)s)")
    parser.add_argument("--metrics-port-file", type=Path, default=None, help="write the bound metrics port here (atomically)")
    parser.add_argument("--max-batch", type=int, default=d.max_batch,
                        help="images per sampling batch; the UNet always runs on this many rows (default %(default)s)")
    parser.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                        help="longest wait for a batch to fill (default %(default)s)")
    parser.add_argument("--max-request-images", type=int, default=d.max_request_images,
                        help="most images one request may ask for (default %(default)s)")
    parser.add_argument("--max-concurrent-rpcs", type=int, default=d.max_concurrent_rpcs,
                        help="RPCs past this get RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--queue-limit", type=int, default=d.queue_limit,
                        help="most images queued for sampling; beyond it RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device, help="default %(default)s")
    parser.add_argument("--ddim-steps", type=int, default=None, help="DDIM steps (default: the model folder's)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance weight w (default: the model folder's)")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch CPU threads, 0 = torch's default; 1 is fastest on a crowded CPU (default %(default)s)")
    parser.add_argument("--grace", type=float, default=d.grace_s, help="seconds in-flight RPCs get on SIGTERM (default %(default)s)")
    tls.add_tls_arguments(parser, server=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    security = tls.ServerSecurity.from_args(args, "generator")
    config = ServeConfig(
        model=args.model, host=security.bind_host(args.host), port=args.port, port_file=args.port_file, metrics_port=args.metrics_port,
        max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_request_images=args.max_request_images,
        max_concurrent_rpcs=args.max_concurrent_rpcs, queue_limit=args.queue_limit, device=args.device,
        ddim_steps=args.ddim_steps, guidance=args.guidance, threads=args.threads, grace_s=args.grace,
    )
    server = GeneratorServer(config, registry=REGISTRY, security=security)
    stopped = grpcutil.stop_on_signals(server.server, server.health, grace_s=config.grace_s)
    port = server.start()
    print(f"generator listening on {config.host}:{port} (metrics port {server.metrics_port})", flush=True)
    if config.port_file is not None:
        write_atomic(config.port_file, f"{port}\n")
    if args.metrics_port_file is not None and server.metrics_port is not None:
        write_atomic(args.metrics_port_file, f"{server.metrics_port}\n")
    try:
        server.load()
    except BaseException:
        server.stop(grace_s=0)
        raise
    stopped.wait()
    server.close()
    log.info("generator stopped")
    return 0
