"""ResNet-18's weights from a server to N clients and back, per round: our runtime beside Flower, same machine, same run.

Ours: a real `fedsynth coordinator` (ResNet-18, a tiny CIFAR-shaped npz dataset, `train.max_steps=0`) and N real
`fedsynth client` processes, one client each. Flower: `flwr.server.start_server` with FedAvg seeded with the same
arrays (the numpy float32 state_dict of our `build_model("resnet18", ...)`) and N `flwr.client.start_client`
processes whose NumPyClient.fit returns the received arrays unchanged; no Flower evaluation. Both ends of both
frameworks run on localhost as separate OS processes.

Flower pins protobuf < 7 and our runtime needs protobuf 7, so the Flower processes run under another interpreter
(`--flower-python`, a virtualenv holding only flwr and numpy); this script re-invokes itself there with `--role`.
"Seconds per round" is the period between consecutive round ends seen by each server (rounds 2..R), which covers
everything a round costs; each framework's own round timer is shown too. MB/s counts 2·N·(weights size) per round.

    python benchmarks/flower_compare.py --flower-python /tmp/flwr-venv/bin/python --clients 1 4 --rounds 5
    python benchmarks/flower_compare.py --flower-python /tmp/flwr-venv/bin/python --model cnn --clients 10 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MB = 1e6
HERE = Path(__file__).resolve()


# ---- Flower roles: run under --flower-python, import nothing of ours -------------------------------------------

def flower_server(args: argparse.Namespace) -> None:
    import flwr as fl

    with np.load(args.arrays) as stored:
        arrays = [stored[f"a{i}"] for i in range(len(stored.files))]
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}

    class TimedFedAvg(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
            starts[server_round] = time.monotonic()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # type: ignore[no-untyped-def]
            if failures or len(results) != args.clients:
                raise RuntimeError(f"round {server_round}: {len(results)} results, {len(failures)} failures")
            aggregated = super().aggregate_fit(server_round, results, failures)
            ends[server_round] = time.monotonic()
            return aggregated

    strategy = TimedFedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.clients, min_evaluate_clients=0,
        min_available_clients=args.clients, initial_parameters=fl.common.ndarrays_to_parameters(arrays),
    )
    fl.server.start_server(server_address=f"127.0.0.1:{args.port}", config=fl.server.ServerConfig(num_rounds=args.rounds), strategy=strategy)
    Path(args.timings).write_text(json.dumps({"starts": starts, "ends": ends}))


def flower_client(args: argparse.Namespace) -> None:
    import flwr as fl

    class EchoClient(fl.client.NumPyClient):
        def get_parameters(self, config):  # type: ignore[no-untyped-def]
            return []

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return parameters, 1, {}

    fl.client.start_client(server_address=f"127.0.0.1:{args.port}", client=EchoClient().to_client(), insecure=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_flower(flower_python: str, folder: Path, arrays_file: Path, clients: int, rounds: int) -> dict[str, list[float]]:
    port, timings = free_port(), folder / f"flower-{clients}.json"
    common = ["--arrays", str(arrays_file), "--clients", str(clients), "--rounds", str(rounds), "--port", str(port), "--timings", str(timings)]
    log = open(folder / f"flower-{clients}.log", "w")
    server = subprocess.Popen([flower_python, str(HERE), "--role", "flower-server", *common], stdout=log, stderr=subprocess.STDOUT)
    time.sleep(3.0)  # start_client retries until the server listens; this only keeps its log short
    workers = [subprocess.Popen([flower_python, str(HERE), "--role", "flower-client", *common], stdout=log, stderr=subprocess.STDOUT) for _ in range(clients)]
    try:
        if server.wait(timeout=1800) != 0:
            raise RuntimeError(f"Flower server exited {server.returncode}; see {folder / f'flower-{clients}.log'}")
    finally:
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
        log.close()
    record = json.loads(timings.read_text())
    ends = [record["ends"][str(r)] for r in range(1, rounds + 1)]
    own = [record["ends"][str(r)] - record["starts"][str(r)] for r in range(1, rounds + 1)]
    return {"periods": [b - a for a, b in zip(ends, ends[1:])], "own": own}


# ---- our runtime --------------------------------------------------------------------------------------------------

def run_ours(folder: Path, clients: int, rounds: int, model: str) -> dict[str, list[float]]:
    from local_federation import run_local_federation  # ours only: this file also runs under Flower's venv

    run_dir = folder / f"ours-{clients}"
    settings = {
        "data.dataset": "cifar10", "data.data_dir": str(folder), "data.clients": clients, "data.partition": "iid",
        "data.min_size": 0, "train.model": model, "train.rounds": rounds, "train.max_steps": 0,
        "generation.policy": "none", "runtime.heartbeat_s": 5.0, "runtime.heartbeat_timeout_s": 15.0,
    }
    ends: list[float] = []
    record = run_local_federation(run_dir, settings, clients=clients, clients_per_process=1,
                                  on_round=lambda _coordinator: ends.append(time.monotonic()), watch_timeout_s=1800, exit_timeout_s=120)
    return {"periods": [b - a for a, b in zip(ends, ends[1:])], "own": [r["duration_s"] for r in record["rounds"]]}


def model_arrays(name: str) -> list[np.ndarray]:
    from fedsynth.models import build_model

    model = build_model(name, num_classes=10, in_channels=3, image_size=32)
    return [t.detach().cpu().numpy().astype(np.float32) for t in model.state_dict().values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flower-python", help="an interpreter with flwr installed (its own virtualenv)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run; periods are taken over rounds 2..R")
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "cnn"], help="cnn: round overhead rather than transfer")
    parser.add_argument("--role", choices=["flower-server", "flower-client"], help=argparse.SUPPRESS)
    parser.add_argument("--arrays", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "flower-server":
        args.clients = args.clients[0]
        return flower_server(args)
    if args.role == "flower-client":
        return flower_client(args)
    if not args.flower_python:
        parser.error("--flower-python is required (flwr pins protobuf < 7; install it in its own virtualenv)")
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 to measure a period between rounds, got {args.rounds}")

    version = subprocess.run([args.flower_python, "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True, check=True).stdout.strip()
    arrays = model_arrays(args.model)
    size = sum(a.nbytes for a in arrays)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedsynth-flower-") as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(0)
        for split, n in (("train", 40 * max(args.clients)), ("test", 20)):
            np.savez(folder / f"{split}.npz", x=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), y=np.arange(n) % 10)
        arrays_file = folder / f"{args.model}.npz"
        np.savez(arrays_file, **{f"a{i}": a for i, a in enumerate(arrays)})
        for n in args.clients:
            ours = run_ours(folder, n, args.rounds, args.model)
            flower = run_flower(args.flower_python, folder, arrays_file, n, args.rounds)
            rows.append((n, ours, flower))

    print(f"{args.model}: {len(arrays)} float32 arrays, {size / MB:.1f} MB; flwr {version}; {args.rounds} rounds, medians over "
          f"rounds 2..{args.rounds}; {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| clients | ours s/round | ours MB/s | Flower s/round | Flower MB/s | ours ÷ Flower time | ours own round timer s | Flower own round timer s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, ours, flower in rows:
        o, f = statistics.median(ours["periods"]), statistics.median(flower["periods"])
        moved = 2 * n * size / MB
        print(f"| {n} | {o:.3f} | {moved / o:,.0f} | {f:.3f} | {moved / f:,.0f} | {o / f:.2f} | "
              f"{statistics.median(ours['own'][1:]):.3f} | {statistics.median(flower['own'][1:]):.3f} |")


if __name__ == "__main__":
    main()
