"""Round overhead of the runtime: round time minus the slowest client's training, for 10 clients, training ~off.

Starts a real coordinator and client-node processes (digits, the small CNN by default), runs the rounds with
`train.max_steps` set to its smallest accepted value, and reads each round's `phases_s` from coordinator.json.
It also timestamps the pushed round summaries (WatchRounds), so the period between rounds, which adds the
checkpoint write and the next payload's encoding, is reported too. Prints a markdown table.

    python benchmarks/round_overhead.py --clients 10 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from fedsynth.training import LocalTrainConfig
from local_federation import run_local_federation


def fewest_steps() -> int:
    """0 (no training at all) where LocalTrainConfig accepts it, else 1 optimizer step per round."""
    try:
        LocalTrainConfig(max_steps=0)
        return 0
    except ValueError:
        return 1


def run(folder: Path, args: argparse.Namespace, max_steps: int) -> tuple[dict, list[float]]:
    settings = {
        "data.clients": args.clients, "train.rounds": args.rounds, "train.model": args.model, "train.max_steps": max_steps,
        "generation.policy": "none", "runtime.heartbeat_s": 2.0,
    }
    arrivals: list[float] = []
    record = run_local_federation(folder, settings, clients=args.clients, clients_per_process=args.clients_per_process,
                                  on_round=lambda _coordinator: arrivals.append(time.monotonic()), watch_timeout_s=1800, exit_timeout_s=60)
    return record, arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients-per-process", type=int, default=5, help="logical clients per client-node process")
    parser.add_argument("--model", default="cnn", choices=["cnn", "resnet18"])
    args = parser.parse_args()
    max_steps = fewest_steps()
    with tempfile.TemporaryDirectory(prefix="fedsynth-overhead-") as tmp:
        record, arrivals = run(Path(tmp), args, max_steps)

    rounds = record["rounds"]
    print(f"{args.clients} clients in {-(-args.clients // args.clients_per_process)} client processes, digits, {args.model}, "
          f"train.max_steps={max_steps}; {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| round | round time s | slowest training s | overhead s | dispatch s | communication s | aggregation s | evaluation s | period − training s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    overheads, periods = [], []
    for i, r in enumerate(rounds):
        p = r["phases_s"]
        overhead = r["duration_s"] - p["training"]
        period = (arrivals[i] - arrivals[i - 1] - p["training"]) if i > 0 else float("nan")
        overheads.append(overhead)
        if i > 0:
            periods.append(period)
        print(f"| {r['round']} | {r['duration_s']:.3f} | {p['training']:.3f} | {overhead:.3f} | {p['dispatch']:.3f} | "
              f"{p['communication']:.3f} | {p['aggregation']:.3f} | {p['evaluation']:.3f} | {period:.3f} |")
    print(f"\nmedian overhead {statistics.median(overheads):.3f} s per round (max {max(overheads):.3f}); "
          f"median period minus training {statistics.median(periods):.3f} s (period: time between consecutive round "
          "summaries at a watcher; it adds the checkpoint write and the next payload's encoding)")


if __name__ == "__main__":
    main()
