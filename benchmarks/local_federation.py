"""One benchmark federation on localhost: a real coordinator and client processes, a callback at each round's end."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from fedsynth.wire import grpcutil
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc


def run_local_federation(
    folder: Path,
    settings: dict[str, Any],
    *,
    clients: int,
    clients_per_process: int,
    on_round: Callable[[Child], None],
    watch_timeout_s: float,
    exit_timeout_s: float,
    on_start: Callable[[Child, list[Child]], None] | None = None,
    coordinator_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run `settings` (--set keys) with clients in processes of clients_per_process each; call on_start(coordinator,
    client nodes) once the coordinator is serving and the nodes are started (before round 1), and on_round(coordinator)
    as each round's summary arrives; return the coordinator's record (coordinator.json). Raises if the run fails.
    `coordinator_args`: more flags for the coordinator (e.g. --data-port, --metrics-port)."""
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={json.dumps(value)}")]
    group = ProcessGroup(folder / "logs")
    try:
        port_file = folder / "coordinator.port"
        coordinator = group.start("coordinator", fedsynth_command("coordinator", *sets, "--out-dir", str(folder / "run"), "--port", "0", "--port-file", str(port_file), "--insecure", *coordinator_args))
        address = f"127.0.0.1:{wait_for_file(port_file, coordinator, timeout_s=180)}"
        nodes: list[Child] = []
        for lo in range(0, clients, clients_per_process):
            ids = f"{lo}-{min(lo + clients_per_process, clients) - 1}" if clients_per_process > 1 else str(lo)
            nodes.append(group.start(f"client-{ids}", fedsynth_command("client", "--coordinator", address, "--clients", ids, "--torch-threads", "1", "--cache-dir", str(folder / "cache"), "--insecure")))
        if on_start is not None:
            on_start(coordinator, nodes)
        with grpcutil.make_channel(address) as channel:
            for summary in pb_grpc.CoordinatorStub(channel).WatchRounds(pb.WatchRequest(), timeout=watch_timeout_s, wait_for_ready=True):
                if summary.finished:
                    if not summary.success:
                        raise RuntimeError(f"run failed: {summary.message}")
                    break
                on_round(coordinator)
        coordinator.process.wait(timeout=exit_timeout_s)
    finally:
        group.stop_all(grace_s=10.0)
    return json.loads((folder / "run" / "coordinator.json").read_text())


def cifar_shaped_folder(folder: Path, *, train: int, test: int) -> Path:
    """Random 32x32x3 uint8 images with labels 0..9 in turn as train.npz/test.npz (`data.dataset = "cifar10"`,
    `data.data_dir = folder`): ResNet-18 at CIFAR's input size without a download."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        np.savez(folder / f"{split}.npz", x=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), y=np.arange(n) % 10)
    return folder
