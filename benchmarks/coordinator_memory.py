"""The coordinator's resident memory over many rounds: its peak above start-up, and does it grow? Training off.

Starts a real coordinator and client-node processes with `train.max_steps=0` (digits and the small CNN, or
ResNet-18 on CIFAR-shaped 32x32x3 data, `--test-images` of them for the coordinator's test pass), records the
coordinator's memory once it is serving and the nodes are started (the start-up baseline, before round 1), then
right after each pushed round summary (WatchRounds): VmRSS, VmHWM (the peak RSS so far) and RssAnon from
/proc/PID/status, for the coordinator and every client node. Reports the coordinator's peak minus its start-up RSS (what the rounds cost: `import torch` alone is
~500 MiB), the RSS at the first and last round, and the growth per round as the slope of a least-squares line over
all rounds, over the second half, and after round 5. Prints a markdown table; --json also writes the samples.

    python benchmarks/coordinator_memory.py --clients 10 --rounds 100
    python benchmarks/coordinator_memory.py --model resnet18 --clients 10 --clients-per-process 10 --rounds 100 --json F
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from deploy.processes import Child
from local_federation import cifar_shaped_folder, run_local_federation

MIB = 1 << 20
FIELDS = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon"}


def memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of a live process, in bytes (the kernel reports kB)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            found[FIELDS[name]] = int(value.split()[0]) * 1024
    if len(found) != len(FIELDS):
        raise RuntimeError(f"/proc/{pid}/status lacks {sorted(set(FIELDS.values()) - set(found))}")
    return found


def settings_for(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "data.clients": args.clients, "train.rounds": args.rounds, "train.model": args.model, "train.max_steps": 0,
        "generation.policy": "none", "runtime.heartbeat_s": 2.0, "runtime.data_plane": args.data_plane,
    }
    if args.model == "resnet18":
        # 100 images per client, 20 test images (as benchmarks/transport.py): the coordinator's test pass, which runs
        # beside the next round, stays small beside the model traffic (its activations grow with the test batch:
        # ~1 MiB per image at 32x32, not with the clients).
        data = cifar_shaped_folder(folder / "data", train=100 * args.clients, test=args.test_images)
        # a loaded 2-core machine moving 447 MB each way per round must not drop a client between heartbeats
        settings.update({"data.dataset": "cifar10", "data.data_dir": str(data), "data.partition": "iid",
                         "runtime.heartbeat_timeout_s": 20.0})
    return settings


def sample(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """{"coordinator": {"startup": m, "rounds": [m, ...]}, "nodes": {role: {...}}}, m as memory() returns it."""
    record: dict[str, Any] = {"coordinator": {"rounds": []}, "nodes": {}}
    nodes: list[Child] = []

    def on_start(coordinator: Child, started: list[Child]) -> None:
        record["coordinator"]["startup"] = memory(coordinator.pid)
        nodes.extend(started)
        for node in started:  # just spawned: a node has no start-up baseline of its own (it loads after this)
            record["nodes"][node.role] = {"rounds": []}

    def on_round(coordinator: Child) -> None:
        record["coordinator"]["rounds"].append(memory(coordinator.pid))
        for node in nodes:
            record["nodes"][node.role]["rounds"].append(memory(node.pid))

    run_local_federation(folder, settings_for(folder, args), clients=args.clients, clients_per_process=args.clients_per_process,
                         on_round=on_round, on_start=on_start, watch_timeout_s=3600 * 4, exit_timeout_s=120)
    if len(record["coordinator"]["rounds"]) != args.rounds:
        raise RuntimeError(f"sampled {len(record['coordinator']['rounds'])} rounds, expected {args.rounds}")
    return record


def slope(samples: list[int], first: int) -> float:
    """Least-squares bytes per round over samples[first:]."""
    rounds = np.arange(first + 1, len(samples) + 1, dtype=np.float64)
    return float(np.polyfit(rounds, np.asarray(samples[first:], dtype=np.float64), 1)[0])


def summary(process: dict[str, Any]) -> dict[str, float | None]:
    """MiB figures of one process: peak, RSS at rounds 1/5/last, growth per round, and with a start-up baseline
    the start-up RSS and the peak minus it."""
    rss = [m["rss"] for m in process["rounds"]]
    n, half = len(rss), len(rss) // 2
    startup = {}
    if "startup" in process:
        startup = {"startup_rss_mib": process["startup"]["rss"] / MIB,
                   "peak_minus_startup_mib": (process["rounds"][-1]["hwm"] - process["startup"]["rss"]) / MIB}
    return {
        **startup,
        "peak_mib": process["rounds"][-1]["hwm"] / MIB,
        "rss_round1_mib": rss[0] / MIB,
        "rss_round5_mib": rss[min(5, n) - 1] / MIB,
        "rss_last_mib": rss[-1] / MIB,
        "max_rss_mib": max(rss) / MIB,
        "growth_kib_per_round_all": slope(rss, 0) / 1024,
        "growth_kib_per_round_second_half": slope(rss, half) / 1024,
        "growth_kib_per_round_after_5": slope(rss, 5) / 1024 if n >= 7 else None,
    }


def kib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients-per-process", type=int, default=5, help="logical clients per client-node process")
    parser.add_argument("--model", default="cnn", choices=["cnn", "resnet18"], help="resnet18 runs on CIFAR-shaped 32x32x3 data")
    parser.add_argument("--test-images", type=int, default=20, help="resnet18: CIFAR-shaped test images the coordinator evaluates")
    parser.add_argument("--data-plane", default="grpc", choices=["grpc", "tcp"], help="runtime.data_plane")
    parser.add_argument("--json", type=Path, help="also write the figures and every sample to this JSON file")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error(f"--rounds must be >= 4 for a fit over the second half, got {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="fedsynth-memory-") as tmp:
        record = sample(Path(tmp), args)

    coordinator = record["coordinator"]
    samples = [m["rss"] for m in coordinator["rounds"]]
    figures = summary(coordinator)
    data = f"CIFAR-shaped 32x32x3 ({args.test_images} test images)" if args.model == "resnet18" else "digits"
    print(f"coordinator memory after each round: {args.clients} clients in {-(-args.clients // args.clients_per_process)} "
          f"client processes, {data}, {args.model}, train.max_steps=0, {args.rounds} rounds, data plane {args.data_plane}; {platform.node()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print(f"start-up (serving, before round 1): RSS {figures['startup_rss_mib']:.1f} MiB, "
          f"RssAnon {coordinator['startup']['anon'] / MIB:.1f} MiB\n")
    print("| after round | RSS MiB | RssAnon MiB | peak (VmHWM) MiB |")
    print("|---:|---:|---:|---:|")
    marks = sorted(r for r in {1, 2, 5, 10, args.rounds // 4, args.rounds // 2, 3 * args.rounds // 4, args.rounds} if 1 <= r <= args.rounds)
    for r in marks:
        m = coordinator["rounds"][r - 1]
        print(f"| {r} | {m['rss'] / MIB:.1f} | {m['anon'] / MIB:.1f} | {m['hwm'] / MIB:.1f} |")
    half = args.rounds // 2
    print(f"\nstart {samples[0] / MIB:.1f} MiB, end {samples[-1] / MIB:.1f} MiB, max {max(samples) / MIB:.1f} MiB; growth per round "
          f"(linear fit) {slope(samples, 0) / 1024:+.1f} KiB over rounds 1..{args.rounds}, "
          f"{slope(samples, half) / 1024:+.1f} KiB over rounds {half + 1}..{args.rounds}")
    print(f"coordinator peak minus start-up: {figures['peak_minus_startup_mib']:.1f} MiB (peak {figures['peak_mib']:.1f} MiB); "
          f"growth after round 5 {kib(figures['growth_kib_per_round_after_5'])} per round\n")
    print("| client node | RSS after round 1 MiB | after round 5 MiB | at the end MiB | peak (VmHWM) MiB | growth per round after round 5 |")
    print("|---|---:|---:|---:|---:|---:|")
    nodes = {role: summary(node) for role, node in record["nodes"].items()}
    for role, f in nodes.items():
        print(f"| {role} | {f['rss_round1_mib']:.1f} | {f['rss_round5_mib']:.1f} | {f['rss_last_mib']:.1f} | "
              f"{f['peak_mib']:.1f} | {kib(f['growth_kib_per_round_after_5'])} |")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": args.model, "test_images": args.test_images if args.model == "resnet18" else None, "clients": args.clients, "clients_per_process": args.clients_per_process,
            "rounds": args.rounds, "data_plane": args.data_plane, "host": platform.node(), "load_average": os.getloadavg()[0],
            "coordinator": figures, "nodes": nodes, "samples_bytes": record,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
