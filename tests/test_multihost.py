"""Multi-host FedEAS in network namespaces: five hosts on a private bridge with mutual TLS, then the same run
behind a 100 ms one-way delay relay with 2% random loss. Local mode: each client host gets only its own folder
(`fedsynth data split`), the coordinator none. Plus the relay alone (no root needed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.netns.delay_relay import DelayRelay
from deploy.netns.netns_lab import NetnsLab, list_namespaces, missing_requirements
from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from fedsynth.allocation import fedeas_generation_row
from fedsynth.assembly import client_shard
from fedsynth.config import load_config

pytestmark = pytest.mark.serial  # fixed namespace names, packet loss and time bounds: runs alone

PREFIX = "fsyntest"  # every namespace of this test is fsyntest-*: found and removed by name after a crash
CLIENTS = 3
HOSTS = ("coordinator", "generator", *(f"client-{k}" for k in range(CLIENTS)))
DELAY_MS = 100.0  # one way, each direction: +200 ms round trip
LOSS_PERCENT = 2.0
RELAY = Path(__file__).resolve().parents[1] / "deploy" / "netns" / "delay_relay.py"
SETTINGS: dict[str, Any] = {
    "seed": 5,
    "data.dataset": "digits",
    "data.clients": CLIENTS,
    "data.source": "local",  # each client host holds only its own folder; the coordinator holds no data
    "train.model": "cnn",
    "train.rounds": 2,
    "train.local_epochs": 1,
    "generation.policy": "fedeas",
    "generation.beta": 12.0,
    "runtime.round_timeout_s": 120.0,
    "runtime.registration_timeout_s": 240.0,  # a deadline, not a speed check: process start-up is slow on a busy machine
    "runtime.heartbeat_s": 1.0,
}
RUN_TIMEOUT_S = 150.0


def _overrides() -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in SETTINGS.items()]


def _planned_generation() -> dict[str, np.ndarray]:
    """Images per class each client should generate: FedEAS from its own shard's label counts (the folders `data split`
    writes hold split mode's shards)."""
    cfg = load_config(None, [*_overrides(), 'data.source="split"'])
    return {
        str(k): fedeas_generation_row(np.bincount(client_shard(cfg, k).y, minlength=10), cfg.generation.beta)
        for k in range(CLIENTS)
    }


def _cached_per_class(cache_dir: Path, client_id: int) -> np.ndarray:
    """Images per class in a client's synthetic cache, from the cache's manifest."""
    manifest = json.loads((cache_dir / f"client-{client_id:04d}" / "manifest.json").read_text())
    return np.array([sum(p["count"] for p in manifest["parts"].get(str(c), [])) for c in range(10)], dtype=np.int64)


def _provision(root: Path, lab: NetnsLab) -> dict[str, Path]:
    """Certificates for the lab's addresses; each host gets a folder with the CA and its own pair only."""
    every = root / "tls-all"
    subprocess.run(
        fedsynth_command("deploy", "provision", "--out", str(every), "--clients", str(CLIENTS),
                         "--coordinator-hosts", lab.address("coordinator"), "--generator-hosts", lab.address("generator")),
        check=True, capture_output=True, timeout=60,
    )
    folders = {}
    for host in HOSTS:
        folder = root / f"tls-{host}"
        folder.mkdir(mode=0o700)
        for name in ("ca.pem", f"{host}.pem", f"{host}-key.pem"):
            shutil.copy2(every / name, folder / name)
        folders[host] = folder
    return folders


def _train_tiny_generator(root: Path) -> Path:
    out = root / "generator-model"
    subprocess.run(
        fedsynth_command("generator", "train", "--dataset", "digits", "--size", "tiny", "--steps", "4", "--batch-size", "16",
                         "--out", str(out), "--no-progress", "--grid-per-class", "0", "--threads", "1"),
        check=True, capture_output=True, timeout=120,
    )
    return out


def _client_folders(root: Path) -> Path:
    """One folder per client host, cut from digits with the run's seed (what each host would hold on its own disk)."""
    out = root / "client-data"
    subprocess.run(fedsynth_command("data", "split", "--dataset", "digits", "--clients", str(CLIENTS), "--alpha", "0.1",
                                    "--seed", str(SETTINGS["seed"]), "--out", str(out)),
                   check=True, capture_output=True, timeout=120)
    return out


def _start_in(lab: NetnsLab, group: ProcessGroup, host: str, role: str, argv: list[str], port_file: Path) -> tuple[Child, int]:
    """Start argv inside host's namespace and wait for the port it binds there."""
    child = group.start(role, lab.command(host, argv))
    return child, int(wait_for_file(port_file, child, timeout_s=240.0))


def _start_relay(lab: NetnsLab, group: ProcessGroup, host: str, role: str, target_port: int, root: Path) -> tuple[Child, str]:
    """A delay relay on the server's host, in front of its port; clients dial the relay's address instead."""
    address = lab.address(host)
    port_file = root / f"{role}.port"
    argv = [sys.executable, str(RELAY), "--listen", f"{address}:0", "--target", f"{address}:{target_port}",
            "--delay-ms", str(DELAY_MS), "--port-file", str(port_file)]
    child, port = _start_in(lab, group, host, role, argv, port_file)
    return child, f"{address}:{port}"


def _stop(child: Child) -> int:
    child.process.send_signal(signal.SIGTERM)
    return child.process.wait(timeout=15)


def _federated_run(lab: NetnsLab, group: ProcessGroup, tls: dict[str, Path], run: Path, generator: str, *, delayed: bool,
                   data: Path) -> dict:
    """Coordinator and one client process per client host; returns coordinator.json once every process exited 0."""
    run.mkdir()
    name = run.name
    sets = [item for override in _overrides() for item in ("--set", override)]
    coordinator, port = _start_in(lab, group, "coordinator", f"{name}-coordinator", fedsynth_command(
        "coordinator", *sets, "--out-dir", str(run / "out"), "--host", lab.address("coordinator"), "--port", "0",
        "--port-file", str(run / "coordinator.port"), "--metrics-port", "-1", "--tls-dir", str(tls["coordinator"]),
    ), run / "coordinator.port")
    coordinator_address = f"{lab.address('coordinator')}:{port}"
    relay = None
    if delayed:
        relay, coordinator_address = _start_relay(lab, group, "coordinator", f"{name}-coordinator-relay", port, run)
    clients = [
        group.start(f"{name}-client-{k}", lab.command(f"client-{k}", fedsynth_command(
            "client", "--coordinator", coordinator_address, "--generator", generator, "--clients", str(k),
            "--tls-dir", str(tls[f"client-{k}"]), "--cache-dir", str(run / f"cache-{k}"), "--torch-threads", "1",
            "--reconnect-timeout", "60", "--metrics-port", "-1", "--data", str(data / f"client-{k}"),
        )))
        for k in range(CLIENTS)
    ]
    try:
        code = coordinator.process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, f"{name}: coordinator exit {code}; log tail:\n{coordinator.log_path.read_text()[-3000:]}"
    for client in clients:
        assert client.process.wait(timeout=30) == 0, f"{client.role}:\n{client.log_path.read_text()[-2000:]}"
    if relay is not None:
        assert _stop(relay) == 0, f"the relay did not stop cleanly on SIGTERM:\n{relay.log_path.read_text()[-2000:]}"
    return json.loads((run / "out" / "coordinator.json").read_text())


def _assert_generated_as_planned(record: dict, run: Path, planned: dict[str, np.ndarray]) -> None:
    assert record["success"] and len(record["rounds"]) == 2
    # The coordinator holds no test set: every round's accuracy is the clients' federated one, from their own folders.
    assert all(r["accuracy"] is not None and r["accuracy"] == r["federated_evaluation"]["weighted_accuracy"]
               for r in record["rounds"])
    assert {k: v["images"] for k, v in record["generation"].items()} == {k: int(row.sum()) for k, row in planned.items()}
    assert sum(int(row.sum()) for row in planned.values()) > 0
    for k in range(CLIENTS):
        assert _cached_per_class(run / f"cache-{k}", k).tolist() == planned[str(k)].tolist()
        assert record["generation"][str(k)]["cache_hit"] is False  # every run generated its own images over the network


def _figures(record: dict) -> dict[str, list[float]]:
    """Per-round seconds, printed so that a CI log shows what was measured."""
    phases = {key: [round(r["phases_s"][key], 3) for r in record["rounds"]] for key in ("communication", "dispatch", "training", "generation")}
    return {**phases, "duration": [round(r["duration_s"], 3) for r in record["rounds"]]}


@pytest.mark.slow
@pytest.mark.netns
def test_fedeas_across_namespaces_clean_then_delayed_and_lossy(tmp_path: Path) -> None:
    problems = missing_requirements(loss=True)
    assert not problems, "this test needs a Linux host with root, iproute2 and nftables (or iptables): " + "; ".join(problems)
    planned = _planned_generation()
    model = _train_tiny_generator(tmp_path)
    data = _client_folders(tmp_path)
    lab = NetnsLab(HOSTS, prefix=PREFIX)
    group = ProcessGroup(tmp_path / "logs")
    try:
        with lab:
            tls = _provision(tmp_path, lab)
            try:
                generator_port_file = tmp_path / "generator.port"
                _, generator_port = _start_in(lab, group, "generator", "generator", fedsynth_command(
                    "generator", "serve", "--model", str(model), "--host", lab.address("generator"), "--port", "0",
                    "--port-file", str(generator_port_file), "--metrics-port", "-1", "--threads", "1",
                    "--tls-dir", str(tls["generator"]),
                ), generator_port_file)
                generator = f"{lab.address('generator')}:{generator_port}"
                started = time.monotonic()
                clean = _federated_run(lab, group, tls, tmp_path / "clean", generator, delayed=False, data=data)
                clean_wall = time.monotonic() - started

                for k in range(CLIENTS):
                    lab.add_loss(f"client-{k}", LOSS_PERCENT)
                generator_relay, generator = _start_relay(lab, group, "generator", "generator-relay", generator_port, tmp_path)
                started = time.monotonic()
                delayed = _federated_run(lab, group, tls, tmp_path / "delayed", generator, delayed=True, data=data)
                delayed_wall = time.monotonic() - started
                assert _stop(generator_relay) == 0
                dropped = {k: lab.dropped_packets(f"client-{k}") for k in range(CLIENTS)}
            finally:
                group.stop_all(grace_s=5.0)
    finally:
        leftover = list_namespaces(PREFIX)
        assert not leftover, f"namespaces left behind: {leftover}"

    walls = {"clean": round(clean_wall, 1), "delayed": round(delayed_wall, 1)}
    print(json.dumps({"clean": _figures(clean), "delayed": _figures(delayed), "wall_s": walls, "dropped_packets": dropped}))
    _assert_generated_as_planned(clean, tmp_path / "clean", planned)
    _assert_generated_as_planned(delayed, tmp_path / "delayed", planned)
    assert sum(dropped.values()) > 0, "the loss rules dropped nothing"
    # A round without generation: every client's task crosses the relay out and its update back, so the coordinator
    # waits at least one added RTT beyond the slowest training. (Round 1 also generates; the coordinator subtracts
    # the slowest generation AND the slowest training there, which clamps its communication to 0 in both runs.)
    rtt_s = 2 * DELAY_MS / 1000
    later = [(c, d) for c, d in zip(clean["rounds"], delayed["rounds"]) if d["phases_s"]["generation"] == 0]
    assert later, "no round without generation to compare"
    for clean_round, delayed_round in later:
        assert delayed_round["phases_s"]["communication"] >= 0.95 * rtt_s
        assert delayed_round["phases_s"]["communication"] - clean_round["phases_s"]["communication"] >= 0.8 * rtt_s

def test_delay_relay_delays_each_direction_and_keeps_the_stream_pipelined() -> None:
    delay_s = 0.05

    async def scenario() -> tuple[float, list[float], bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", server.sockets[0].getsockname()[1]), delay_s)
        reader, writer = await asyncio.open_connection("127.0.0.1", await relay.start())
        started = time.monotonic()
        writer.write(b"x")
        await reader.readexactly(1)
        rtt = time.monotonic() - started
        # 10 one-byte messages 10 ms apart: if chunks queued behind each other's delay, latency would grow to 10 x RTT.
        sent_at: list[float] = []
        for _ in range(10):
            sent_at.append(time.monotonic())
            writer.write(b"y")
            await asyncio.sleep(0.01)
        latencies = []
        for sent in sent_at:
            await reader.readexactly(1)
            latencies.append(time.monotonic() - sent)
        writer.write_eof()  # the half-close crosses the relay; the echo server closes, and so does the relay
        tail = await asyncio.wait_for(reader.read(), timeout=5)
        writer.close()
        await relay.stop()
        server.close()
        return rtt, latencies, tail

    rtt, latencies, tail = asyncio.run(scenario())
    # Lower bounds are exact; the upper bound only rules out chunks queueing behind each other's delay (the last
    # of 10 would then wait about 10 round trips), with room for a busy machine.
    assert rtt >= 2 * delay_s
    assert all(latency >= 2 * delay_s - 0.005 for latency in latencies), latencies
    assert latencies[-1] < 10 * 2 * delay_s, latencies
    assert tail == b""
