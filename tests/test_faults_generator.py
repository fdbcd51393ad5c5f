"""Fault injection on the generation path: kill -9 the generator mid-stream, restart it, lose nothing."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from deploy.processes import Child, fedsynth_command, wait_for_file
from fedsynth.allocation import fedeas_generation_row
from fedsynth.assembly import client_shard
from runtime_harness import Runtime, config, read_record, wait_exit, wait_until

SETTINGS: dict[str, object] = {
    "data.clients": 2,
    "train.rounds": 1,
    "train.local_epochs": 1,
    "generation.policy": "fedeas",
    "generation.beta": 6.0,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _generator(runtime: Runtime, model: Path, port: int, name: str) -> Child:
    port_file = runtime.root / f"{name}.port"
    port_file.unlink(missing_ok=True)
    # 30 DDIM steps on batches of 4: slow enough to be killed half-way through a client's stream.
    child = runtime.group.start(
        name,
        fedsynth_command("generator", "serve", "--model", str(model), "--port", str(port), "--port-file", str(port_file),
                         "--metrics-port", "-1", "--max-batch", "4", "--ddim-steps", "30", "--threads", "1", "--insecure"),
    )
    wait_for_file(port_file, child, timeout_s=90)
    return child


def _cached_counts(cache: Path, client_id: int) -> np.ndarray:
    manifest = cache / f"client-{client_id:04d}" / "manifest.json"
    if not manifest.is_file():
        return np.zeros(10, dtype=np.int64)
    parts = json.loads(manifest.read_text())["parts"]
    return np.array([sum(p["count"] for p in parts.get(str(c), [])) for c in range(10)], dtype=np.int64)


@pytest.mark.slow
def test_generator_killed_mid_stream_restarts_and_caches_exactly_the_plan(runtime: Runtime, tmp_path: Path, tiny_generator: Path) -> None:
    cfg = config(SETTINGS)
    planned = {k: fedeas_generation_row(np.bincount(client_shard(cfg, k).y, minlength=10), cfg.generation.beta) for k in range(2)}
    assert all(p.sum() > 8 for p in planned.values())
    port = _free_port()
    first = _generator(runtime, tiny_generator, port, "generator")
    coordinator = runtime.coordinator(SETTINGS, tmp_path / "run")
    command = fedsynth_command("client", "--coordinator", coordinator.address, "--clients", "0-1", "--generator", f"127.0.0.1:{port}",
                               "--cache-dir", str(runtime.root / "cache"), "--torch-threads", "1", "--insecure")
    clients = runtime.group.start("clients", command)

    cache = runtime.root / "cache"
    wait_until(lambda: sum(_cached_counts(cache, k).sum() for k in range(2)) > 0, timeout_s=180, what="first cached images")
    runtime.kill(first)  # kill -9 mid-stream: some images cached, the rest not yet generated
    partial = {k: _cached_counts(cache, k) for k in range(2)}
    assert any((partial[k] < planned[k]).any() for k in range(2)), "generation finished before the kill; slow it down"
    _generator(runtime, tiny_generator, port, "generator-restarted")

    assert coordinator.wait(timeout_s=300) == 0, coordinator.log()[-2000:]
    assert wait_exit(clients, 60) == 0
    for k in range(2):
        assert np.array_equal(_cached_counts(cache, k), planned[k]), k  # no gaps, no duplicates
    record = read_record(tmp_path / "run")
    assert {int(k): v["images"] for k, v in record["generation"].items()} == {k: int(p.sum()) for k, p in planned.items()}
