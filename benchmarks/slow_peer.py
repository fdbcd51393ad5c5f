"""The slow-peer attack on every port the coordinator opens, beside the same run unattacked.

A real federation (ResNet-18 on CIFAR-shaped data, no training, runtime.data_plane = "tcp" so that every payload
crosses the data plane) runs twice, one run after the other: untouched, then while an attacker on another address
(127.0.0.2) holds N connections open on EACH port the coordinator listens on (gRPC, data plane, /metrics), sending one
byte of a valid-looking request (HTTP/2's preface, the data plane's magic, an HTTP GET) every 4 s and reconnecting
whenever it is cut off. Before 2026-12-06, 48 such connections on the data plane held all 32 of its workers and one
round took 42.5 s against a 2.1 s median. Prints each run's round times (critical path: waiting + aggregation) and
their ratio; the target is attacked within 20 % of untouched.

    python benchmarks/slow_peer.py --rounds 30 --attackers 64 [--attack-s S] [--plane tcp|grpc] [--json FILE]

(The code measured is the one `python -m fedsynth.cli` finds from the current directory: run it from a checkout's root.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from deploy.processes import Child, wait_for_file
from local_federation import cifar_shaped_folder, run_local_federation

ATTACKER = "127.0.0.2"
PREFIXES = {  # what each port expects first: the attacker trickles it, byte by byte, and never finishes
    "grpc": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "data plane": b"FSD2" + b"\x01" + b"\0" * 16 + b"\0\0\0\0",
    "metrics": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
}


class Attacker:
    """N connections to each port, one byte each every `period_s`; a connection cut off is opened again."""

    def __init__(self, ports: dict[str, int], per_port: int, period_s: float = 4.0, lasts_s: float = 0.0) -> None:
        self.ports, self.per_port, self.period_s = ports, per_port, period_s
        self.ends = time.monotonic() + lasts_s if lasts_s > 0 else float("inf")
        self.cut_off = {name: 0 for name in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def __enter__(self) -> Attacker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _open(self, name: str) -> tuple[socket.socket, int] | None:
        """A new connection that has sent its first byte."""
        try:
            sock = socket.create_connection(("127.0.0.1", self.ports[name]), timeout=2, source_address=(ATTACKER, 0))
            sock.send(PREFIXES[name][:1])
        except OSError:
            return None
        return sock, 1

    def _run(self) -> None:
        held: dict[str, list[tuple[socket.socket, int] | None]] = {name: [self._open(name) for _ in range(self.per_port)]
                                                                     for name in self.ports}
        while not self._stop.wait(self.period_s) and time.monotonic() < self.ends:
            for name, conns in held.items():
                prefix = PREFIXES[name]
                for i, entry in enumerate(conns):
                    if entry is not None:
                        sock, sent = entry
                        try:
                            sock.send(prefix[sent % len(prefix) : sent % len(prefix) + 1])
                            conns[i] = (sock, sent + 1)
                            continue
                        except OSError:
                            sock.close()
                            self.cut_off[name] += 1
                    conns[i] = self._open(name)
        for conns in held.values():
            for entry in conns:
                if entry is not None:
                    entry[0].close()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def round_time(summary: dict[str, Any]) -> float:
    """A round on the critical path: from its start to its aggregate (as benchmarks/round_overhead.py)."""
    return summary["phases_s"]["waiting"] + summary["phases_s"]["aggregation"]


def run(folder: Path, args: argparse.Namespace, attacked: bool) -> dict[str, Any]:
    name = "attacked" if attacked else "untouched"
    settings = {
        "data.dataset": "cifar10", "data.data_dir": str(folder / "data"), "data.clients": args.clients, "data.partition": "iid",
        "data.min_size": 0, "train.model": "resnet18", "train.rounds": args.rounds, "train.max_steps": 0,
        "generation.policy": "none", "runtime.heartbeat_s": 2.0, "runtime.heartbeat_timeout_s": 6.0, "runtime.data_plane": args.plane,
    }
    data_port, metrics_file = free_port(), folder / f"{name}.metrics-port"
    extra = ["--metrics-port", "0", "--metrics-port-file", str(metrics_file)]
    if args.plane == "tcp":
        extra += ["--data-port", str(data_port)]
    attacker: list[Attacker] = []

    def on_start(coordinator: Child, _nodes: list[Child]) -> None:
        if not attacked:
            return
        ports = {"grpc": int((folder / name / "coordinator.port").read_text()),
                 "metrics": wait_for_file(metrics_file, coordinator, timeout_s=60)}
        if args.plane == "tcp":
            ports["data plane"] = data_port
        attacker.append(Attacker(ports, args.attackers, lasts_s=args.attack_s).__enter__())

    try:
        record = run_local_federation(folder / name, settings, clients=args.clients, clients_per_process=args.clients,
                                      on_round=lambda _c: None, on_start=on_start, watch_timeout_s=1800, exit_timeout_s=120,
                                      coordinator_args=extra)
    finally:
        for a in attacker:
            a.__exit__()
    times = [round_time(r) for r in record["rounds"]]
    return {"round_s": times, "median_s": statistics.median(times), "max_s": max(times), "total_s": sum(times),
            "cut_off": attacker[0].cut_off if attacker else {}, "final_accuracy": record["rounds"][-1]["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--attackers", type=int, default=64, help="trickling connections per port (default %(default)s)")
    parser.add_argument("--plane", choices=("tcp", "grpc"), default="tcp", help="runtime.data_plane (default %(default)s)")
    parser.add_argument("--attack-s", type=float, default=0.0, help="end the attack after this long (default: it lasts the run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedsynth-slow-peer-") as tmp:
        folder = Path(tmp)
        cifar_shaped_folder(folder / "data", train=20 * args.clients, test=4)
        results = {"untouched": run(folder, args, attacked=False), "attacked": run(folder, args, attacked=True)}
    ratio = results["attacked"]["median_s"] / results["untouched"]["median_s"]
    total_ratio = results["attacked"]["total_s"] / results["untouched"]["total_s"]
    ports = "gRPC, data plane and /metrics" if args.plane == "tcp" else "gRPC and /metrics"
    during = f"for {args.attack_s:.0f} s" if args.attack_s else "all run"
    print(f"ResNet-18, {args.clients} clients, runtime.data_plane = {args.plane}, {args.rounds} rounds; {args.attackers} trickling "
          f"connections on each of {ports} ({during}); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"{time.monotonic() - started:.0f} s in all\n")
    print("| run | round time, median (s) | slowest round (s) | all rounds (s) | attacker's connections cut off | final accuracy |")
    print("|---|---:|---:|---:|---|---:|")
    for name, result in results.items():
        cut = ", ".join(f"{port} {n}" for port, n in result["cut_off"].items()) or "-"
        print(f"| {name} | {result['median_s']:.2f} | {result['max_s']:.2f} | {result['total_s']:.1f} | {cut} | {result['final_accuracy']:.4f} |")
    print(f"\nattacked ÷ untouched: median round {ratio:.2f}, all rounds {total_ratio:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({**results, "ratio": ratio, "total_ratio": total_ratio, "load_average": os.getloadavg()[0], "plane": args.plane,
                                         "attackers_per_port": args.attackers}, indent=2) + "\n")


if __name__ == "__main__":
    main()
