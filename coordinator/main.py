"""`fedsynth coordinator`: serve the Coordinator service and drive the rounds of one run."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path

import torch

from coordinator.members.refusals import run_record
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import create_server
from fedsynth.process import allocator, lifetime
from fedsynth.wire import grpcutil, tls
from fedsynth.config import generator_addresses, load_config
from fedsynth.errors import ConfigError, QuorumError
from fedsynth.process.provenance import provenance
from fedsynth.process.metrics import add_metrics_arguments, linger_for_final_scrape, serve_metrics_from_args
from fedsynth.learning.hardware import resolve_hardware
from fedsynth.learning.partition import check_partition
from fedsynth.process.runtime import EXIT_BELOW_QUORUM, EXIT_INTERNAL, EXIT_OK, setup_logging, write_atomic, write_json

log = logging.getLogger("coordinator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML); without it the embedded default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.rounds=5")
    parser.add_argument("--out-dir", help="run folder for the checkpoint and coordinator.json (default: the config's out_dir)")
    parser.add_argument("--host", default=None, help="address to bind (default: the config's runtime.host with TLS; 127.0.0.1 with --insecure)")
    parser.add_argument("--port", type=int, default=None, help="port to bind; 0 picks a free one (default: runtime.coordinator_port)")
    parser.add_argument("--port-file", help="write the bound port to this file once serving")
    parser.add_argument("--data-port", type=int, default=0,
                        help="with runtime.data_plane = \"tcp\": the data plane's port on the same host (default 0: a free one, "
                             "announced to each client at registration; fix it where a firewall must let it through)")
    add_metrics_arguments(parser, linger=True)
    parser.add_argument("--generator", metavar="HOST:PORT", default=None,
                        help="the public generator service (train.algorithm = \"pe\": Private Evolution's candidates)")
    parser.add_argument("--log-level", default="INFO")
    tls.add_tls_arguments(parser, server=True)


def run(args: argparse.Namespace) -> int:
    setup_logging("coordinator", args.log_level)
    allocator.tune_for_large_buffers()  # before any model-sized buffer: big blocks mmapped, freed back to the OS
    security = tls.ServerSecurity.from_args(args, "coordinator")
    security.credentials()  # read and checked before anything else starts
    cfg = load_config(args.config, args.set)
    if cfg.data.source == "split":  # local mode: the clients hold their own data, nothing to split
        check_partition(cfg)  # an impossible split fails here, in seconds, before the server binds
    resolve_hardware(cfg.train.device, cfg.train.precision)  # "cuda" on a machine without one: refused before it binds
    torch.set_num_threads(cfg.runtime.torch_threads)
    out_dir = Path(args.out_dir or cfg.out_dir)
    version = provenance()  # the code that plays this run, read before it starts (a checkout may change meanwhile)
    git = version["git"]
    log.info("fedsynth %s (%s), torch %s, grpcio %s", version["fedsynth"],
             "not a git checkout" if git is None else f"commit {git['commit'][:12]}{' dirty' if git['dirty'] else ''}",
             version["packages"]["torch"], version["packages"]["grpcio"])
    host = security.bind_host(args.host, cfg.runtime.host)
    port = cfg.runtime.coordinator_port if args.port is None else args.port
    metrics_server = serve_metrics_from_args(args, security.files, security.revoked)
    if args.generator is not None and len(generator_addresses(args.generator, key="--generator")) != 1:
        raise ConfigError(f"--generator names one generator (HOST:PORT), got {args.generator!r}")
    if not 0 <= args.data_port <= 65535:
        raise ConfigError(f"--data-port must be a port number (0-65535), got {args.data_port}")
    coordinator, bound = create_server(cfg, out_dir=out_dir, host=host, port=port, data_port=args.data_port, security=security,
                                       metrics=CoordinatorMetrics(), generator=args.generator,
                                       generator_credentials=tls.channel_credentials(security.files) if security.files else None)
    federation = coordinator.federation
    # 2 s for in-flight RPCs on SIGTERM: completed rounds are checkpointed already, and a child must be gone soon
    # after its launcher (the parent-death signal) or a service manager asks.
    stopped = grpcutil.stop_on_signals(coordinator.server, coordinator.health, grace_s=2.0,
                                       before_stop=federation.close_streams)
    log.info("coordinator serving on %s:%d (%s; run %s, resuming after round %d)", host, bound,
             "mutual TLS" if security.files else "PLAINTEXT", federation.run_id, federation.completed)
    if args.port_file:
        write_atomic(Path(args.port_file), str(bound))

    outcome: dict[str, object] = {}

    def _drive() -> None:
        try:
            federation.run()
            outcome["code"] = EXIT_OK
        except QuorumError as exc:
            log.error("%s", exc)
            outcome.update(code=EXIT_BELOW_QUORUM, error=str(exc))
        except Exception as exc:  # the clients were told (RunFinished); the record and the exit code say it too
            log.exception("internal error in the round loop")
            outcome.update(code=EXIT_INTERNAL, error=f"coordinator internal error: {type(exc).__name__}: {exc}")

    driver = threading.Thread(target=_drive, name="rounds", daemon=True)
    driver.start()
    while driver.is_alive() and not stopped.is_set():
        driver.join(timeout=0.5)
    if stopped.is_set():
        federation.driver.wait_for_evaluation(timeout_s=30.0)  # an aggregated round's checkpoint is still kept
        log.info("stopped by signal after round %d (checkpoint kept)", federation.driver.checkpointed)
        lifetime.exit_now(143)
    federation.drain(timeout_s=10.0)
    write_json(
        out_dir / "coordinator.json",
        {
            "run_id": federation.run_id,
            "version": version,
            "config": cfg.to_dict(),
            "init_weights": federation.init_weights,  # train.init_weights' {"path", "sha256"}, or null
            "initial": federation.initial,
            "rounds": federation.history,
            "generation": {str(k): v for k, v in sorted(federation.generation_reports().items())},
            "sdafl": federation.sdafl.privacy_report() if federation.sdafl is not None else None,
            "privacy": federation.privacy_report(),
            **run_record(federation.history),  # refused_updates, excluded_clients
            "success": outcome.get("code") == EXIT_OK,
            "error": outcome.get("error"),
            "exit_code": int(outcome.get("code", EXIT_BELOW_QUORUM)),
            "finished_unix": time.time(),
        },
    )
    coordinator.stop(grace_s=2.0)
    linger_for_final_scrape(metrics_server, args.metrics_linger_s, stopped)
    # Everything is written and the server is down: skip the interpreter's teardown (1-2 s after torch, and a hang
    # under load was seen once), whose thread joins can only delay the exit code the launcher waits for.
    lifetime.exit_now(int(outcome.get("code", EXIT_BELOW_QUORUM)))
