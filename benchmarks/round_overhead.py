"""Round overhead of the runtime: round time minus the slowest client's training, with training ~off.

Starts a real coordinator and client-node processes (digits and the small CNN by default; `--data cifar-shaped`
gives random 32x32x3 images for ResNet-18 at CIFAR's input size), runs the rounds with `train.max_steps` set to its
smallest accepted value, and reads each round's `phases_s` from coordinator.json: dispatch is the time from the
round's start (the previous round closed and the new payload was encoded) until the last sampled client's task was
written to its stream. It also timestamps the pushed round summaries (WatchRounds), so the period between rounds,
which adds the checkpoint write and the next payload's encoding, is reported too. Prints a markdown table.

    python benchmarks/round_overhead.py --clients 10 --rounds 10
    python benchmarks/round_overhead.py --clients 100 --clients-per-process 25 --partition iid --rounds 10
    python benchmarks/round_overhead.py --clients 100 --clients-per-process 25 --fraction 0.1 --model resnet18 \
        --data cifar-shaped --partition iid --rounds 10 --json out.json

`--partition iid`: at K = 100 digits' 1,437 training images have no Dirichlet(0.1) split with 10 images per client
(the partitioner refuses it); with training off the split only changes shard sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from fedsynth.learning.training import LocalTrainConfig
from local_federation import cifar_shaped_folder, run_local_federation


def fewest_steps() -> int:
    """0 (no training at all) where LocalTrainConfig accepts it, else 1 optimizer step per round."""
    try:
        LocalTrainConfig(max_steps=0)
        return 0
    except ValueError:
        return 1


def round_time(summary: dict) -> float:
    """A round on the critical path: from its start to its aggregate (report.json's duration_s adds the test
    evaluation, which runs beside the next round)."""
    return summary["phases_s"]["waiting"] + summary["phases_s"]["aggregation"]


def run(folder: Path, args: argparse.Namespace, max_steps: int) -> tuple[dict, list[float]]:
    settings = {
        "data.clients": args.clients, "train.rounds": args.rounds, "train.model": args.model, "train.max_steps": max_steps,
        "train.fraction": args.fraction, "data.partition": args.partition,
        "generation.policy": "none", "runtime.heartbeat_s": 2.0, "runtime.data_plane": args.data_plane,
        "runtime.data_plane_min_bytes": args.data_plane_min_bytes,
    }
    if args.data == "cifar-shaped":
        # 20 test images, as benchmarks/transport.py: the test pass (beside the next round) costs ~0.04 s per image for
        # ResNet-18 on this CPU and would take a core from the round it runs beside.
        data = cifar_shaped_folder(folder / "data", train=20 * args.clients, test=20)
        settings.update({"data.dataset": "cifar10", "data.data_dir": str(data), "data.min_size": 1})
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
    parser.add_argument("--fraction", type=float, default=1.0, help="train.fraction: share of clients sampled per round")
    parser.add_argument("--partition", default="dirichlet", choices=["dirichlet", "iid"], help="data.partition")
    parser.add_argument("--data", default="digits", choices=["digits", "cifar-shaped"])
    parser.add_argument("--data-plane", default="grpc", choices=["grpc", "tcp"],
                        help="runtime.data_plane (tcp moves payloads of 4 MiB and more, ResNet-18's, beside gRPC)")
    parser.add_argument("--data-plane-min-bytes", type=int, default=4 << 20,
                        help="runtime.data_plane_min_bytes (default %(default)s; 0 sends the small CNN's 0.2 MB by the data plane too)")
    parser.add_argument("--json", type=Path, help="also write the per-round figures and medians to this JSON file")
    args = parser.parse_args()
    max_steps = fewest_steps()
    with tempfile.TemporaryDirectory(prefix="fedsynth-overhead-") as tmp:
        record, arrivals = run(Path(tmp), args, max_steps)

    rounds = record["rounds"]
    load = os.getloadavg()[0]
    print(f"{args.clients} clients in {-(-args.clients // args.clients_per_process)} client processes, fraction {args.fraction}, "
          f"{args.data}, {args.model}, partition {args.partition}, train.max_steps={max_steps}, data plane {args.data_plane} (from {args.data_plane_min_bytes} bytes); "
          f"{platform.node()}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f}\n")
    print("| round | round time s | slowest training s | overhead s | dispatch s | communication s | aggregation s | "
          "evaluation s (beside the next round) | period − training s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    overheads, periods = [], []
    for i, r in enumerate(rounds):
        p = r["phases_s"]
        critical = round_time(r)
        overhead = critical - p["training"]
        period = (arrivals[i] - arrivals[i - 1] - p["training"]) if i > 0 else float("nan")
        overheads.append(overhead)
        if i > 0:
            periods.append(period)
        print(f"| {r['round']} | {critical:.3f} | {p['training']:.3f} | {overhead:.3f} | {p['dispatch']:.3f} | "
              f"{p['communication']:.3f} | {p['aggregation']:.3f} | {p['evaluation']:.3f} | {period:.3f} |")
    later = rounds[1:] or rounds  # round 1 carries the clients' first-round set-up
    summary = {
        "clients": args.clients, "clients_per_process": args.clients_per_process, "fraction": args.fraction,
        "model": args.model, "data": args.data, "partition": args.partition, "data_plane": args.data_plane,
        "data_plane_min_bytes": args.data_plane_min_bytes, "load_average": load,
        "median_overhead_s": statistics.median(overheads), "max_overhead_s": max(overheads),
        "median_round_s": statistics.median(round_time(r) for r in later),
        "median_dispatch_s": statistics.median(r["phases_s"]["dispatch"] for r in later),
        "median_period_minus_training_s": statistics.median(periods) if periods else None,
        "rounds": [{"round": r["round"], "duration_s": r["duration_s"], "phases_s": r["phases_s"]} for r in rounds],
    }
    print(f"\nmedian overhead {summary['median_overhead_s']:.3f} s per round (max {max(overheads):.3f}); rounds 2+: median "
          f"round {summary['median_round_s']:.3f} s, median dispatch {summary['median_dispatch_s']:.3f} s; median period "
          f"minus training {statistics.median(periods):.3f} s (period: time between consecutive round summaries at a "
          "watcher; it adds the checkpoint write and the next payload's encoding)")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
