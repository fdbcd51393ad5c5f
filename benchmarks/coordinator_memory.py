"""The coordinator's resident memory over many rounds: does it grow? 10 clients, digits, the small CNN, training off.

Starts a real coordinator and client-node processes with `train.max_steps=0`, watches the pushed round summaries
(WatchRounds), and right after each one reads the coordinator process's VmRSS from /proc/PID/status. Reports
the RSS at the first and last round and the growth per round as the slope of a least-squares line, over all
rounds and over the second half (warm-up excluded). Prints a markdown table.

    python benchmarks/coordinator_memory.py --clients 10 --rounds 100
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

from local_federation import run_local_federation

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process, in bytes (the kernel reports kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line in /proc/{pid}/status")


def sample_rss(folder: Path, args: argparse.Namespace) -> list[int]:
    settings = {
        "data.clients": args.clients, "train.rounds": args.rounds, "train.model": "cnn", "train.max_steps": 0,
        "generation.policy": "none", "runtime.heartbeat_s": 2.0,
    }
    samples: list[int] = []
    run_local_federation(folder, settings, clients=args.clients, clients_per_process=args.clients_per_process,
                         on_round=lambda coordinator: samples.append(rss_bytes(coordinator.pid)), watch_timeout_s=3600, exit_timeout_s=60)
    if len(samples) != args.rounds:
        raise RuntimeError(f"sampled {len(samples)} rounds, expected {args.rounds}")
    return samples


def slope(samples: list[int], first: int) -> float:
    """Least-squares bytes per round over samples[first:]."""
    rounds = np.arange(first + 1, len(samples) + 1, dtype=np.float64)
    return float(np.polyfit(rounds, np.asarray(samples[first:], dtype=np.float64), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients-per-process", type=int, default=5, help="logical clients per client-node process")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error(f"--rounds must be >= 4 for a fit over the second half, got {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="fedsynth-memory-") as tmp:
        samples = sample_rss(Path(tmp), args)

    print(f"coordinator VmRSS after each round: {args.clients} clients, digits, cnn, train.max_steps=0, {args.rounds} rounds; "
          f"{platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| after round | RSS MiB |")
    print("|---:|---:|")
    marks = sorted(r for r in {1, 2, 5, 10, args.rounds // 4, args.rounds // 2, 3 * args.rounds // 4, args.rounds} if 1 <= r <= args.rounds)
    for r in marks:
        print(f"| {r} | {samples[r - 1] / MIB:.1f} |")
    half = args.rounds // 2
    print(f"\nstart {samples[0] / MIB:.1f} MiB, end {samples[-1] / MIB:.1f} MiB, max {max(samples) / MIB:.1f} MiB; growth per round "
          f"(linear fit) {slope(samples, 0) / 1024:+.1f} KiB over rounds 1..{args.rounds}, "
          f"{slope(samples, half) / 1024:+.1f} KiB over rounds {half + 1}..{args.rounds}")


if __name__ == "__main__":
    main()
