"""`fedsynth generator serve`: the generator process: load a backend (a model folder, held-out images, or a saved
diffusers text-to-image pipeline), serve it."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry

from fedsynth.wire import grpcutil, tls
from fedsynth.process import lifetime
from fedsynth.config_schema import DATASETS
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_names import SERVICE_NAME
from fedsynth.process.metrics import add_metrics_arguments, choose_metrics_tls
from fedsynth.process.runtime import write_atomic
from fedsynth.wire.strict_decoding import add_strictly
from fedsynth.v1 import generator_pb2_grpc
from generator_service.backends import BACKENDS, build_backend, get_backend
from generator_service.batcher import Batcher
from generator_service.metrics import GeneratorMetrics, serve_registry
from generator_service.quality_filter import BATCHES_PER_CALL, load_quality_filter
from generator_service.servicer import GeneratorServicer, ServedModel

log = logging.getLogger(__name__)
BATCH_STOP_WAIT_S = 1.0  # after SIGTERM's grace, how long the batch being sampled may take to finish
LOAD_POLL_S = 0.2  # how often the main thread looks for a stop signal while the backend loads


# The flags each backend takes, and those it requires; a flag only other backends take is refused, not ignored.
BACKEND_FLAGS: dict[str, tuple[str, ...]] = {
    "ddpm": ("model", "ddim_steps", "guidance"),
    "holdout": ("dataset", "data_dir", "holdout_fraction", "seed", "holdout_dir"),
    "text2image": ("model", "dataset", "data_dir", "ddim_steps", "guidance", "prompt_template", "class_names_file"),
}
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {"ddpm": ("model",), "holdout": ("dataset", "holdout_fraction", "seed"),
                                              "text2image": ("model", "dataset")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServeConfig:
    model: Path | None = None
    backend: str = "ddpm"
    dataset: str | None = None  # holdout: the run's data.dataset, data.data_dir, data.holdout_fraction and seed
    data_dir: Path | None = None
    holdout_fraction: float | None = None
    seed: int | None = None
    holdout_dir: Path | None = None  # holdout in local mode: `fedsynth data split --holdout-fraction`'s OUT/holdout
    prompt_template: str | None = None  # text2image: None is "a photo of a {name}"
    class_names_file: Path | None = None  # text2image: one name per line; built in for digits and CIFAR
    host: str = "127.0.0.1"
    port: int = 0
    port_file: Path | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_insecure: bool = False  # plain HTTP /metrics even when the server runs with mutual TLS
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
    min_confidence: float = 0.0  # the quality filter: serve only images the judge gives >= this for their class; 0 = off
    judge_cache: Path | None = None  # None: $FEDSYNTH_CACHE/judges (as `fedsynth generator evaluate`)
    filter_batches: int = BATCHES_PER_CALL  # the quality filter takes this many --max-batch of keys at once

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for other, flags in BACKEND_FLAGS.items():
            for name in flags:
                if name not in self._flags() and getattr(self, name) is not None:
                    also = " (the quality filter reads it with --min-confidence > 0)" if name == "data_dir" else ""
                    raise ConfigError(f"{_flag(name)} is a flag of --backend {other}, not of --backend {self.backend}"
                                      f"{also}")
        if self.holdout_dir is not None and any(getattr(self, name) is not None for name in ("dataset", "data_dir", "holdout_fraction", "seed")):
            raise ConfigError("--holdout-dir serves that folder as it is: give it without --dataset, --data-dir, "
                              "--holdout-fraction and --seed")
        for name in REQUIRED_FLAGS.get(self.backend, ()):
            if getattr(self, name) is None and self.holdout_dir is None:
                raise ConfigError(f"--backend {self.backend} needs {_flag(name)}")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ConfigError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.holdout_fraction is not None and not 0.0 < self.holdout_fraction < 1.0:
            raise ConfigError(f"--holdout-fraction must be in (0, 1) for --backend holdout, got {self.holdout_fraction}")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        for name in ("max_batch", "max_request_images", "max_concurrent_rpcs", "queue_limit", "filter_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
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
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"--min-confidence must be in [0, 1) (0 = no quality filter), got {self.min_confidence}")
        if self.judge_cache is not None and self.min_confidence == 0:
            raise ConfigError("--judge-cache is read only with --min-confidence > 0")

    def _flags(self) -> tuple[str, ...]:
        """This backend's flags; with the quality filter also --data-dir, where the judge's training data lies."""
        return BACKEND_FLAGS[self.backend] + (("data_dir",) if self.min_confidence > 0 else ())


class GeneratorServer:
    """start() binds and serves health (NOT_SERVING); load() loads the backend, then health says SERVING."""

    def __init__(self, config: ServeConfig, *, registry: CollectorRegistry | None = None,
                 security: tls.ServerSecurity | None = None) -> None:
        self.config = config
        self.security = security or tls.ServerSecurity(files=None)  # in-process default: plaintext, as before
        backend = get_backend(config.backend)
        if backend.check is not None:
            backend.check(config)  # fail fast (e.g. a wrong model folder), before binding anything
        self.metrics_tls = choose_metrics_tls(config.metrics_port, config.metrics_host, config.metrics_insecure,
                                              self.security.files)  # refuses plain HTTP off loopback, before binding
        self.metrics = GeneratorMetrics(registry)
        self.server = grpcutil.make_server(max_workers=config.max_concurrent_rpcs + 8,
                                           max_concurrent_rpcs=config.max_concurrent_rpcs)
        self.health = grpcutil.add_health(self.server, SERVICE_NAME)
        self.servicer = GeneratorServicer(metrics=self.metrics, max_request_images=config.max_request_images)
        add_strictly(generator_pb2_grpc.add_GeneratorServicer_to_server, self.security.guard(self.servicer), self.server)
        self.batcher: Batcher | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_http: WSGIServer | None = None

    def start(self) -> int:
        self.port = grpcutil.bind(self.server, f"{self.config.host}:{self.config.port}", self.security.credentials())
        self.server.start()
        self._metrics_http = serve_registry(self.config.metrics_port, self.metrics.registry, self.config.metrics_host,
                                            self.metrics_tls, self.security.revoked)
        self.metrics_port = None if self._metrics_http is None else int(self._metrics_http.server_port)
        return self.port

    def load(self) -> ServedModel:
        started = time.perf_counter()
        backend = build_backend(self.config)
        if self.config.min_confidence > 0:
            backend = load_quality_filter(backend, min_confidence=self.config.min_confidence,
                                          max_batch=self.config.max_batch, data_dir=self.config.data_dir,
                                          judge_cache=self.config.judge_cache, threads=self.config.threads,
                                          metrics=self.metrics)
        self.metrics.filter_min_confidence.set(self.config.min_confidence)
        served = backend.description
        keys_per_call = self.config.max_batch * (self.config.filter_batches if self.config.min_confidence > 0 else 1)
        self.batcher = Batcher(backend.sample, max_batch=keys_per_call,
                               max_wait_s=self.config.max_wait_ms / 1000.0, queue_limit=self.config.queue_limit,
                               metrics=self.metrics)
        model = ServedModel(backend, self.batcher, max_batch=self.config.max_batch)
        self.servicer.attach(model)
        self.metrics.model_load_seconds.set(time.perf_counter() - started)
        self.metrics.info.info({"backend": served.backend, "size": served.size, "model_id": served.model_id,
                                "device": served.device, "dtype": served.dtype,
                                "min_confidence": f"{self.config.min_confidence:g}"})
        grpcutil.set_serving(self.health, SERVICE_NAME)
        log.info("serving %s (backend %s, %d classes of %s images) on %s, %s", served.model_id, served.backend,
                 served.num_classes, "x".join(map(str, served.image_shape)), served.device, served.dtype)
        if served.backend in ("ddpm", "text2image"):
            log.info("%s, %d parameters, %d steps, guidance %.2f", served.size, served.parameters,
                     served.ddim_steps, served.guidance)
        return model

    def stop(self, grace_s: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.close()

    def close(self, wait_s: float = 60.0) -> bool:
        """Release the batcher and the metrics endpoint (after the gRPC server has stopped); False if a sampling
        batch was still running after wait_s."""
        finished = self.batcher.close(wait_s) if self.batcher is not None else True
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        return finished


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig(model=Path("."))
    parser.add_argument("--backend", choices=tuple(BACKENDS), default=d.backend,
                        help="ddpm: a trained model (--model); holdout: real held-out training images, a perfect generator "
                             "(--dataset, --holdout-fraction, --seed as in the run's config); text2image: a diffusers "
                             "text-to-image pipeline saved in --model, prompted by --dataset's class names "
                             "(default %(default)s)")
    parser.add_argument("--model", type=Path, default=None,
                        help="ddpm: generator folder (from `fedsynth generator train`); text2image: a folder written by "
                             "a diffusers pipeline's save_pretrained (never downloaded)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="holdout, text2image: the run's data.dataset (text2image: class names and resolution)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="holdout, text2image (npz), and any backend with --min-confidence (the judge's training "
                             "data): the run's data.data_dir")
    parser.add_argument("--holdout-fraction", type=float, default=None, help="holdout: the run's data.holdout_fraction, in (0, 1)")
    parser.add_argument("--seed", type=int, default=None, help="holdout: the run's seed (it seeds the hold-out split)")
    parser.add_argument("--holdout-dir", type=Path, default=None,
                        help="holdout in local mode: serve this folder of real held-out images (`fedsynth data split "
                             "--holdout-fraction F` writes OUT/holdout; its schema.toml beside it names the classes) instead "
                             "of --dataset/--holdout-fraction/--seed")
    parser.add_argument("--prompt-template", default=None,
                        help='text2image: the prompt, with {name} for the class name (default "a photo of a {name}")')
    parser.add_argument("--class-names-file", type=Path, default=None,
                        help="text2image: one class name per line, class 0 first (needed for npz; digits and CIFAR "
                             "names are built in)")
    parser.add_argument("--host", default=d.host, help="address to listen on; 0.0.0.0 for other machines (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="gRPC port, 0 picks a free one (default %(default)s)")
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound gRPC port here (atomically)")
    add_metrics_arguments(parser, default_port=d.metrics_port)
    parser.add_argument("--max-batch", type=int, default=d.max_batch,
                        help="images per sampling batch; a ddpm UNet always runs on this many rows (default %(default)s)")
    parser.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                        help="longest wait for a batch to fill (default %(default)s)")
    parser.add_argument("--max-request-images", type=int, default=d.max_request_images,
                        help="most images one request may ask for (default %(default)s)")
    parser.add_argument("--max-concurrent-rpcs", type=int, default=d.max_concurrent_rpcs,
                        help="RPCs past this get RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--queue-limit", type=int, default=d.queue_limit,
                        help="most images queued for sampling; beyond it RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device,
                        help="ddpm, text2image: default %(default)s")
    parser.add_argument("--ddim-steps", type=int, default=None,
                        help="ddpm: DDIM steps (default: the model folder's); text2image: the pipeline's inference "
                             "steps (default 4)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="ddpm: guidance weight w (default: the model folder's); text2image: the same w, "
                             "diffusers' guidance_scale = 1 + w (default 0: off, as SD-turbo wants)")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch CPU threads, 0 = torch's default; 1 is fastest on a crowded CPU (default %(default)s)")
    parser.add_argument("--min-confidence", type=float, default=d.min_confidence,
                        help="quality filter: serve only images the judge (`fedsynth generator evaluate`'s classifier, "
                             "trained on the dataset's real training split and cached) assigns to their class with at "
                             "least this probability, drawing more until the counts are met; 0 = off (default %(default)s)")
    parser.add_argument("--judge-cache", type=Path, default=None,
                        help="with --min-confidence: folder of cached judges (default $FEDSYNTH_CACHE/judges or "
                             "~/.cache/fedsynth/judges)")
    parser.add_argument("--filter-batches", type=int, default=d.filter_batches,
                        help="with --min-confidence: the filter takes this many --max-batch of keys at once, so the "
                             "images a batch rejects are retried beside fresh ones, not in a batch of their own; more "
                             "is cheaper, and delays a request's first images (default %(default)s)")
    parser.add_argument("--grace", type=float, default=d.grace_s, help="seconds in-flight RPCs get on SIGTERM (default %(default)s)")
    tls.add_tls_arguments(parser, server=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    security = tls.ServerSecurity.from_args(args, "generator")
    config = ServeConfig(
        model=args.model, backend=args.backend, dataset=args.dataset, data_dir=args.data_dir,
        holdout_fraction=args.holdout_fraction, seed=args.seed, holdout_dir=args.holdout_dir, prompt_template=args.prompt_template,
        class_names_file=args.class_names_file, host=security.bind_host(args.host), port=args.port, port_file=args.port_file, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, metrics_insecure=args.metrics_insecure,
        max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_request_images=args.max_request_images,
        max_concurrent_rpcs=args.max_concurrent_rpcs, queue_limit=args.queue_limit, device=args.device,
        ddim_steps=args.ddim_steps, guidance=args.guidance, threads=args.threads, grace_s=args.grace,
        min_confidence=args.min_confidence, judge_cache=args.judge_cache, filter_batches=args.filter_batches,
    )
    server = GeneratorServer(config, registry=REGISTRY, security=security)
    stopped = grpcutil.stop_on_signals(server.server, server.health, grace_s=config.grace_s)
    port = server.start()
    print(f"generator listening on {config.host}:{port} (metrics port {server.metrics_port})", flush=True)
    if config.port_file is not None:
        write_atomic(config.port_file, f"{port}\n")
    if args.metrics_port_file is not None and server.metrics_port is not None:
        write_atomic(args.metrics_port_file, f"{server.metrics_port}\n")
    # Loading (a model, or training the quality filter's judge: ~15 min for CIFAR-10 on a CPU) runs on a worker
    # thread, so that a SIGTERM meanwhile ends the process at once instead of after the load.
    failure: list[BaseException] = []

    def _load() -> None:
        try:
            server.load()
        except BaseException as exc:  # re-raised on the main thread
            failure.append(exc)

    loader = threading.Thread(target=_load, name="load", daemon=True)
    loader.start()
    while loader.is_alive() and not stopped.is_set():
        loader.join(timeout=LOAD_POLL_S)
    if loader.is_alive():
        # Stopped by a signal while loading. Nothing is half-written: the judge cache is only ever written with
        # write_atomic (a scratch folder renamed into place), so an unfinished judge leaves no cache entry.
        log.info("stopped by signal while loading the backend")
        server.close()
        lifetime.exit_now(lifetime.EXIT_PARENT_GONE)  # 143, as every role stopped by SIGTERM
    if failure:
        server.stop(grace_s=0)
        raise failure[0]
    stopped.wait()
    if not server.close(wait_s=BATCH_STOP_WAIT_S):
        # A quality-filtered batch on a loaded CPU samples for minutes; its requests already failed, and nothing of it
        # is written anywhere, so leave now rather than past the launcher's grace.
        log.info("generator stopped; the sampling batch in flight was abandoned")
        lifetime.exit_now(0)
    log.info("generator stopped")
    return 0
