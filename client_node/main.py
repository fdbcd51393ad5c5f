"""`fedsynth client`: one process hosting one (default) or several logical clients."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

import torch

from client_node.metrics import ClientMetrics
from client_node.node import NodeOptions, run_clients
from client_node.sdafl_client import remove_leftover_shards
from fedsynth.process import lifetime
from fedsynth.wire import tls
from fedsynth.wire.tensor_buffer import ReceiveBuffers
from fedsynth.config import generator_addresses
from fedsynth.errors import ConfigError
from fedsynth.learning.hardware import set_node_device
from fedsynth.process.metrics import add_metrics_arguments, linger_for_final_scrape, serve_metrics_from_args
from fedsynth.process.runtime import setup_logging

log = logging.getLogger("client")

# global-model buffers a client process keeps for reuse; its logical clients beyond two receiving at once take fresh memory
RECEIVE_BUFFERS_KEPT = 2


def parse_ids(text: str) -> list[int]:
    """'3' -> [3]; '0-4' -> [0..4]; '0,2,5-6' -> [0, 2, 5, 6]."""
    ids: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            ids.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise ConfigError(f"--clients expects ids like 3, 0-4 or 0,2,5-6; got {text!r}") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"--clients must name distinct ids >= 0, got {text!r}")
    return ids


def check_address(flag: str, value: str | None) -> None:
    if value is None:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} expects HOST:PORT, got {value!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    parser.add_argument("--clients", default="0", help="logical client ids this process hosts: 3, 0-4 or 0,2,5-6")
    parser.add_argument("--generator", metavar="HOST:PORT",
                        help="the generator service (needed by generation policies); replicas as HOST:PORT,HOST:PORT,... "
                             "or dns:///NAME:PORT (round_robin over NAME's addresses): requests are sharded across them")
    parser.add_argument("--data", action="append", default=[], metavar="PATH or ID=PATH",
                        help="local mode (data.source = \"local\"): this client's own data, a folder (train/<class>/, "
                             "optionally test/<class>/), an .npz or a datasets folder; ID=PATH, repeated, for a node hosting "
                             "several clients; or one folder holding client-<id>/ folders")
    parser.add_argument("--cache-dir", default="fedsynth-cache", help="folder of the persistent synthetic-image cache")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of this process")
    parser.add_argument("--device", metavar="auto|cpu|cuda|cuda:N",
                        help="where this node's clients train, instead of the run config's train.device (e.g. cpu on a "
                             "node without a GPU in a run whose config says cuda); its logical clients share it")
    parser.add_argument("--reconnect-timeout", type=float, default=300.0, help="give up after the coordinator is unreachable this long (s)")
    add_metrics_arguments(parser, linger=True)
    parser.add_argument("--log-level", default="INFO")
    tls.add_tls_arguments(parser, server=False)


def data_paths(values: list[str], ids: list[int]) -> dict[int, Path]:
    """--data PATH / ID=PATH (repeated) / a folder of client-<id>/ folders -> this node's path per client id."""
    if not values:
        return {}
    named: dict[int, Path] = {}
    plain: list[Path] = []
    for value in values:
        key, sep, path = value.partition("=")
        if sep and key.strip().isdigit():
            cid = int(key)
            if cid not in ids or cid in named:
                raise ConfigError(f"--data {value!r}: client {cid} is {'named twice' if cid in named else 'not hosted here'} "
                                  f"(--clients {','.join(map(str, ids))})")
            named[cid] = Path(path).expanduser()
        else:
            plain.append(Path(value).expanduser())
    if len(plain) > 1:
        raise ConfigError(f"--data: give one PATH, or ID=PATH per client; got {len(plain)} plain paths")
    paths = dict(named)
    for cid in ids:
        if cid in paths:
            continue
        if not plain:
            raise ConfigError(f"--data names no path for client {cid} (give {cid}=PATH)")
        folder = plain[0] / f"client-{cid}"
        if folder.is_dir():
            paths[cid] = folder
        elif len(ids) == 1:
            paths[cid] = plain[0]
        else:
            raise ConfigError(f"--data {str(plain[0])!r}: no folder client-{cid}/ in it for client {cid}")
    for cid, path in paths.items():
        if not path.exists():
            raise ConfigError(f"--data: client {cid}'s data {str(path)!r} does not exist")
    return paths


def node_options(args: argparse.Namespace, ids: list[int], revoked: tls.RevocationList | None) -> dict[int, NodeOptions]:
    """One NodeOptions per logical client: with TLS each dials with its own client-K certificate."""
    if len(ids) > 1 and (args.tls_cert or args.tls_key):
        raise ConfigError(f"--tls-cert/--tls-key name one identity but this process hosts clients {args.clients}; "
                          "use --tls-dir (one client-K certificate per logical client)")
    paths = data_paths(args.data, ids)
    buffers = ReceiveBuffers(keep=RECEIVE_BUFFERS_KEPT)
    options = {}
    for cid in ids:
        files = tls.tls_files_from_args(args, f"client-{cid}")
        if files is not None and files.identity().node_id != f"client-{cid}":
            raise ConfigError(f"certificate {files.cert} is {files.identity().node_id}'s, not client-{cid}'s")
        credentials = None if files is None else tls.channel_credentials(files)
        options[cid] = NodeOptions(coordinator=args.coordinator, generator=args.generator, cache_dir=Path(args.cache_dir),
                                   reconnect_timeout_s=args.reconnect_timeout, credentials=credentials,
                                   data_plane_tls=None if files is None else tls.ssl_client_context(files),
                                   tls_files=files, revoked=revoked, data_path=paths.get(cid),
                                   receive_buffers=buffers)
    return options


def run(args: argparse.Namespace) -> int:
    setup_logging("client", args.log_level)
    ids = parse_ids(args.clients)
    check_address("--coordinator", args.coordinator)
    if args.generator is not None:
        generator_addresses(args.generator, key="--generator")
    if args.torch_threads < 1:
        raise ConfigError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    torch.set_num_threads(args.torch_threads)
    device = set_node_device(getattr(args, "device", None))  # checked now: a GPU this machine lacks fails before the node registers
    if device is not None:
        log.info("clients %s train on %s (--device %s)", args.clients, device, args.device)
    # The first optimizer imports torch._dynamo (~3 s): pay it here, not inside a round where a SIGTERM would wait on it.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    first = tls.tls_files_from_args(args, f"client-{ids[0]}")  # /metrics serves HTTPS with the first client's pair
    revoked = tls.revocation_from_args(args, first)
    options = node_options(args, ids, revoked)
    remove_leftover_shards(Path(args.cache_dir))
    metrics_server = serve_metrics_from_args(args, first, revoked)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = run_clients(ids, options, ClientMetrics(), stop)
    if stop.is_set():  # stopped by a signal and shut down: leave at once
        lifetime.exit_now(code)
    linger_for_final_scrape(metrics_server, args.metrics_linger_s, stop)
    return code
