"""One benchmark federation on localhost: a real coordinator and client processes, a callback at each round's end."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from fedsynth import grpcutil
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
) -> dict[str, Any]:
    """Run `settings` (--set keys) with clients in processes of clients_per_process each; call on_round(coordinator)
    as each round's summary arrives; return the coordinator's record (coordinator.json). Raises if the run fails."""
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={json.dumps(value)}")]
    group = ProcessGroup(folder / "logs")
    try:
        port_file = folder / "coordinator.port"
        coordinator = group.start("coordinator", fedsynth_command("coordinator", *sets, "--out-dir", str(folder / "run"), "--port", "0", "--port-file", str(port_file), "--insecure"))
        address = f"127.0.0.1:{wait_for_file(port_file, coordinator, timeout_s=180)}"
        for lo in range(0, clients, clients_per_process):
            ids = f"{lo}-{min(lo + clients_per_process, clients) - 1}" if clients_per_process > 1 else str(lo)
            group.start(f"client-{ids}", fedsynth_command("client", "--coordinator", address, "--clients", ids, "--torch-threads", "1", "--cache-dir", str(folder / "cache"), "--insecure"))
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
